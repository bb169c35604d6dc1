"""The configuration file: its bytes, read bounded, and its YAML, read strictly and at a bounded cost.

Reading (:func:`read_config_file`): only a regular file, at most :data:`MAX_CONFIG_BYTES`, opened without
blocking. The path swapped for ``/dev/zero`` was read until the process held gigabytes; swapped for a FIFO,
every later reload hung on ``open``.

What parsing may cost: a configuration is tens of kilobytes (500 backends and 2,000 keys, written out in blocks,
are 580 KiB and 42,500 YAML nodes), but a 15.5 MB list within the old 16 MiB cap took 29 s and 770 MB to parse,
and reloaded in a serving gateway it held the interpreter long enough to raise the requests' p50 from 4 to 42
ms. So a file is at most 1 MiB and :data:`MAX_CONFIG_NODES` nodes (counted as the document is read, refused at
the first past the bound, before it is built), and its events come from libyaml's parser (the same events,
several times faster) where PyYAML has it; a document libyaml refuses is read again by PyYAML's own parser, so
that the error says what it always said. Reloads parse in a thread, off the event loop
(:mod:`gateway.control`).

Parsing (:func:`read_yaml`): PyYAML keeps the second of two equal keys in one mapping silently (``auth:`` twice:
the first section is gone without a word), so a key written twice is refused, naming it and its lines. And the
document's end is looked at, since a file read while it is rewritten in place ends where the writer had got to:

* a field with no value (``requests_per_minute:``) reads as null, which would lift the limit it names: at the very
  end it is what a cut leaves, inside the file what a template's missing variable leaves; written on purpose,
  null is ``null`` (or ``~``), so an empty value is refused wherever it stands (sweep 28);
* a plain (unquoted) or block value that ends the document with no line break after it may be cut inside
  itself (``-100`` cut to ``-10``, ``llama-3-8b-instruct`` to ``llama-3-8b``, a hash cut after the new key's
  line): a file ends with a line break.

A quoted value cut short, or a flow collection (``[...]``, ``{...}``) cut short, is no YAML at all. What a cut at
a line's end still looks like, a complete file without its later lines, is for the reload's checks
(:mod:`gateway.config_reload`) and is described in docs/operating.md#reloading-the-configuration.
"""

from __future__ import annotations

import codecs
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from yaml._yaml import CParser

_LibYamlParser: type[CParser] | None
try:
    from yaml._yaml import CParser as _LibYamlParser
except ImportError:  # (PyYAML built without libyaml: its own parser, slower, under the same bounds)
    _LibYamlParser = None

MAX_CONFIG_BYTES = 1024 * 1024  # a configuration is kilobytes; this bounds what a wrong path or file can cost
MAX_CONFIG_NODES = 100_000  # scalars, aliases, lists and mappings: twice the 500 backends and 2,000 keys above


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the fields at fault."""


def read_config_file(path: str | Path) -> bytes:
    """The file's bytes, read once: a regular file of at most :data:`MAX_CONFIG_BYTES` (ConfigError otherwise,
    and when it cannot be read). Opened with ``O_NONBLOCK``, so a FIFO put in its place is refused, not waited
    on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise ConfigError(f"cannot read configuration {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"cannot read configuration {path}: not a regular file (a device, FIFO, socket or "
                              "directory)")
        if info.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"cannot read configuration {path}: {info.st_size} bytes, more than the "
                              f"{MAX_CONFIG_BYTES} bytes a configuration may have")
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(1 << 20, MAX_CONFIG_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_CONFIG_BYTES:  # (it grew while read)
                raise ConfigError(f"cannot read configuration {path}: more than the {MAX_CONFIG_BYTES} bytes a "
                                  "configuration may have")
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(f"cannot read configuration {path}: {exc.strerror}") from None
    finally:
        os.close(fd)


# a file written more recently than this may be being rewritten in place: read at start once it has held still this
# long (as the file watch's server.reload_settle_seconds, whose default it is), for at most START_SETTLE_LIMIT
START_SETTLE_SECONDS = 2.0
START_SETTLE_LIMIT = 30.0


def read_config_settled(path: str | Path, settle: float = START_SETTLE_SECONDS, limit: float = START_SETTLE_LIMIT,
                        *, now: Callable[[], float] = time.time,
                        sleep: Callable[[float], None] = time.sleep) -> bytes:
    """The file's bytes as a gateway starts from them, once they have held still. A file written less than
    ``settle`` seconds ago (by its modification time) may be being rewritten in place (``tee``, ``scp``,
    ``rsync --inplace``, a template), and a prefix of it can parse: cut before ``auth:``, a gateway started open
    (sweep 27; a reload compares with the file in force, a start has nothing to compare with). So it is read
    again until it was last modified ``settle`` seconds before the read; one still changing after ``limit``
    seconds is refused. A file written earlier (every start but one right after a write) is read once."""
    began = now()
    while True:
        content = read_config_file(path)
        try:
            modified = os.stat(path).st_mtime
        except OSError as exc:
            raise ConfigError(f"cannot read configuration {path}: {exc.strerror}") from None
        age = now() - modified
        if not 0 <= age < settle:  # (held still long enough; or stamped in the future: no writer's doing now)
            return content
        if now() - began > limit:
            raise ConfigError(f"configuration {path} kept changing for {limit:g} s: not started from it (a file "
                              f"being written is read once it has held still {settle:g} s)")
        sleep(settle - age)


@dataclass(frozen=True, slots=True)
class YamlDocument:
    data: Any  # what the document says (None: nothing, or only comments)
    cut: str | None  # why its end looks cut short, if it does (the caller words the refusal's start)


# a quoted piece of a YAML error message: the document's text, unless it is one character or a token name
_QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")
_TOKEN_NAME = re.compile(r"'<[a-z ]+>'")
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_MERGE = "tag:yaml.org,2002:merge"


def _elide(words: str) -> str:
    return _QUOTED.sub(lambda m: m[0] if len(m[0]) <= 4 or _TOKEN_NAME.fullmatch(m[0]) else "'...'", words)


def _at(mark: yaml.Mark | None) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def _where(exc: yaml.YAMLError) -> str:
    """Where and what, never the document's lines: PyYAML's own message quotes them, and they may hold a key.
    Its problem texts can still quote a piece of the document (the tag or alias an unquoted secret starting
    with '!' or '*' becomes), so quoted pieces are elided; token names such as '<stream end>' stay."""
    if isinstance(exc, yaml.reader.ReaderError):  # (the character's code, never the text around it)
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f": a character YAML does not allow (#x{code:04x}) at character {exc.position + 1}"
    if not isinstance(exc, yaml.MarkedYAMLError):
        return ""
    where = f": {_elide(exc.problem or 'syntax error')}{_at(exc.problem_mark)}"
    if exc.context:
        where += f" ({_elide(exc.context)}{_at(exc.context_mark)})"
    return where


@dataclass(frozen=True, slots=True)
class _Scalar:
    """Where a scalar (or alias) of the document stands, and how it was written."""

    value: str
    style: str | None  # None: plain; ' or ": quoted; | or >: a block; "*": an alias
    line: int  # 1-based
    end: int  # the character index just after it

    @classmethod
    def of(cls, event: yaml.ScalarEvent | yaml.AliasEvent) -> _Scalar:
        start, end = event.start_mark, event.end_mark
        assert start is not None and end is not None  # (the parser marks every event)
        if isinstance(event, yaml.AliasEvent):
            return cls("", "*", start.line + 1, end.index)
        return cls(event.value, event.style or None, start.line + 1, end.index)  # (libyaml's plain style: '')


_NODES = (yaml.ScalarEvent, yaml.AliasEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent)


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping key written twice, counting the document's nodes (past
    :data:`MAX_CONFIG_NODES`, ConfigError), and remembering its last two scalars (the last value and, before it,
    its key). ``fast``: its events come from libyaml's parser."""

    def __init__(self, text: str, source: str, *, fast: bool) -> None:
        super().__init__(text)
        self.source = source
        self.last: _Scalar | None = None
        self.before_last: _Scalar | None = None
        self.nodes = 0
        self.libyaml = _LibYamlParser(text) if fast and _LibYamlParser is not None else None

    def check_event(self, *choices: Any) -> bool:
        if self.libyaml is not None:
            return bool(self.libyaml.check_event(*choices))
        return bool(super().check_event(*choices))

    def peek_event(self) -> Any:
        if self.libyaml is not None:
            return self.libyaml.peek_event()
        return super().peek_event()  # type: ignore[no-untyped-call]

    def get_event(self) -> Any:
        event = self.libyaml.get_event() if self.libyaml is not None else super().get_event()  # type: ignore[no-untyped-call]
        if isinstance(event, _NODES):
            self.nodes += 1
            if self.nodes > MAX_CONFIG_NODES:
                raise ConfigError(f"{self.source}: more than {MAX_CONFIG_NODES} YAML nodes (values, lists and "
                                  "mappings): a configuration has a few thousand; this bounds what reading one may "
                                  "cost")
        if isinstance(event, yaml.ScalarEvent | yaml.AliasEvent):
            self.before_last, self.last = self.last, _Scalar.of(event)
        return event

    def dispose(self) -> None:
        if self.libyaml is not None:
            self.libyaml.dispose()
        super().dispose()

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:  # (``<<: *defaults``: the keys written beside it override, on purpose)
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if (isinstance(value_node, yaml.ScalarNode) and value_node.tag == "tag:yaml.org,2002:null"
                    and value_node.value == "" and not value_node.style):
                # (an empty value reads as null, and null is "none": `max_in_flight:` a template left empty lifted a
                # key's limit, `url:` under state started a replica without the fleet's Redis, sweep 28)
                name = f"{key!r}" if isinstance(key, str) and _FIELD.fullmatch(key) else "a key"
                raise ConfigError(f"{self.source}: {name} at line {line} has no value (what a file cut there, or a "
                                  "template's missing variable, leaves); to mean none, write null")
            try:
                first = lines.get(key)
            except TypeError:  # (an unhashable key: the base class refuses it)
                continue
            lines[key] = line
            if first is not None:
                name = f"{key!r}" if isinstance(key, str) and _FIELD.fullmatch(key) else "a key"
                raise ConfigError(f"{self.source}: {name} is written twice in one mapping (lines {first} and "
                                  f"{line}); YAML would silently keep the second: remove one")
        return super().construct_mapping(node, deep=deep)


def _decode(content: bytes, source: str) -> str:
    # as PyYAML reads bytes: UTF-16 when a byte-order mark says so, else UTF-8 (its own mark is skipped as YAML)
    encoding = "utf-16" if content.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) else "utf-8"
    try:
        return content.decode(encoding)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source} is not valid YAML: not {encoding.upper()} (at byte {exc.start})") from None


def _cut(last: _Scalar | None, key: _Scalar | None, text: str) -> str | None:
    """Why a document whose last scalar is ``last`` (``key``: the one before it) looks cut short, if it does."""
    if last is None:
        return None
    if last.value == "" and last.style is None:  # (an empty plain scalar: only a missing value reads so)
        where = f"an empty value at line {last.line}"
        if key is not None and key.style is None and _FIELD.fullmatch(key.value):
            where = f"'{key.value}:' at line {key.line}"
        return (f"ends with {where}, which has no value: it may have been read half-written (a field without a "
                "value at the end is what a cut leaves); to mean none, write null")
    if last.style not in ("'", '"') and not any(c in text[last.end:] for c in "\n\r#]},"):
        return (f"ends inside a value at line {last.line} (no line break after it): it may have been read "
                "half-written, cut inside that value; end the file with a line break")
    return None


def read_yaml(content: bytes, source: str) -> YamlDocument:
    """The document in ``content``; ``source`` names it in errors. Raises ConfigError for invalid YAML (saying
    where, never quoting the document), for a mapping key written twice and past :data:`MAX_CONFIG_NODES`; a
    document whose end looks cut short comes back with ``cut`` saying why."""
    text = _decode(content, source)
    try:
        return _read(text, source, fast=True)
    except yaml.YAMLError:  # (libyaml's words: PyYAML's parser says where, as the docs and tests know it)
        return _read(text, source, fast=False)


def _read(text: str, source: str, *, fast: bool) -> YamlDocument:
    loader: _StrictLoader | None = None
    try:
        loader = _StrictLoader(text, source, fast=fast)  # (PyYAML's reader refuses control characters here)
        data = loader.get_single_data()
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        if loader is not None and loader.libyaml is not None:
            raise
        raise ConfigError(f"{source} is not valid YAML{_where(exc)}") from None
    except Exception:
        # PyYAML's constructors fail with plain errors, the value in their message, on an explicit tag that does
        # not fit it (``!!int sk-...``); deep nesting ends in RecursionError
        raise ConfigError(f"{source} is not valid YAML: a value does not fit its explicit !! tag, or nesting is "
                          "too deep") from None
    finally:
        if loader is not None:
            loader.dispose()
    return YamlDocument(data, _cut(loader.last, loader.before_last, text) if data is not None else None)
