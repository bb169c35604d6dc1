"""Server-sent events relay: upstream bytes in, client bytes out, every event's framing checked on the way.

What is checked, per event (events end with a blank line):

* a comment (``: ping``) passes;
* otherwise every line must be an SSE field (``data:``, ``event:``, ``id:``, ``retry:``) with at least one
  ``data:`` line, and the data, stripped, must be ``[DONE]`` or look like a JSON object: start with ``{`` and
  end with ``}``;
* the events that matter are parsed in full (orjson) and must be a JSON object: those whose data has a
  ``"usage"`` or ``"timings"`` key with a non-null value or mentions ``"error"`` (found by one regex over the
  bytes; inside a JSON string a quote is escaped, so only a key or a whole string value matches), and the
  event the upstream left unfinished when its stream ended (where a cut connection shows).

Anything else (HTML, bytes that are not SSE, ``data: [1,2]``, ``data: "x"``, a JSON line cut short) raises
:class:`InvalidStream`, so the client does not receive it: the proxy ends its stream with an OpenAI error event
instead (or, before the first byte, tries another backend). What is *not* caught is an ordinary chunk whose
data starts with ``{`` and ends with ``}`` but is not valid JSON inside (``data: {not json}``): it is relayed
as it came. Parsing every event cost more than the rest of the relay put together; the framing check and the
regex are a few hundred nanoseconds an event.

Valid events pass through byte for byte (a block of unchanged events is forwarded as the very bytes that
came); only a usage chunk or an error event is ever re-encoded:

* The gateway always asks the upstream for usage. When the client did not, the usage chunk is removed.
* TabbyAPI's usage chunk carries a non-empty ``choices`` entry; it is split into its content (forwarded as
  a normal chunk when it says anything) and a standard usage chunk with ``choices: []``.
* An upstream error event, in any shape (``{"error": ...}`` with or without ``choices``, the old vLLM ``{"object":
  "error", "message": ...}``, an agent API's ``{"type": "error", ...}``), is scrubbed of the backend's address and
  credentials (``secrets``), every string of it as the client's decoder will read it (``\\u`` escapes
  included); on chat streams it is reshaped into OpenAI's envelope (``reshape_error``). Every other event
  parsed (usage, timings) whose bytes may hold a credential (:meth:`~gateway.errors.Redactor.echoed`, a few
  ``bytes.find``) is scrubbed of the credentials. An ordinary chunk that passes unchanged is not looked at for
  them: that would cost every chunk a scan (see docs/security.md).
* ``hidden`` fields (an engine's cache figures, where they could reveal another cache domain's prompt: see
  :mod:`gateway.proxy.cache_figures`) are removed from the events that carry them (usage and timings events,
  parsed anyway); the relay's own ``usage`` and ``timings`` keep the engine's figures.
* ``\\r\\n`` line endings (TabbyAPI) become ``\\n``. A comment (a keep-alive ping) reaches the client as ``: ping``
  whatever it said, and a comment line inside an event is dropped: nothing reads them, and an engine echoing
  the credentials it was sent put them there (sweep 8). An event's ``event:`` and ``id:`` lines are scrubbed of
  the credentials where their bytes may hold one.
* At most ``MAX_IDLE_BYTES`` of comments and blank lines may come between two data events (a stream of pings
  cost ~30 ms of the event loop per MiB, bounded only by the idle timeout): past it, InvalidStream.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from gateway.engines.spec import ALL_QUIRKS, StreamQuirks
from gateway.errors import Redactor
from gateway.proxy.cache_figures import FieldPath, without

# an upstream that sends this much without ending an event is not speaking SSE
MAX_PENDING_BYTES = 1 << 20
MAX_IDLE_BYTES = 1 << 20  # of comments, blank lines and events without text between two with text
# and in a whole stream: a text event every 1 MiB of comments reset the bound above forever (victim p50 from 3.6 ms
# to 5.2 s, sweep 28); an engine's own (the role's chunk, the usage, a few pings) are a few KiB
MAX_NOISE_BYTES = 4 << 20
# events the relay parses (usage, timings, errors) larger than BIG_ACTED_BYTES: at most MAX_ACTED_BYTES of them in
# one stream (a usage event is a few hundred bytes; back-to-back 1 MiB ones, each parsed, starved the event loop:
# sweep 9)
BIG_ACTED_BYTES = 16 * 1024
MAX_ACTED_BYTES = 1 << 20


class InvalidStream(Exception):
    """The upstream's stream is not well-formed SSE carrying JSON. Its text says what is wrong; the offending
    bytes are kept apart (``sample``), for whoever shows them to scrub first (:meth:`described`): an engine may
    echo its credentials in anything it writes."""

    def __init__(self, problem: str, sample: bytes = b"") -> None:
        super().__init__(problem)
        self.sample = sample

    def described(self, redactor: Redactor) -> str:
        """What is wrong, and the start of the offending bytes, scrubbed of the backend's secrets before cut (with
        its line breaks taken out first: a credential split across two ``data:`` lines is joined by one)."""
        if not self.sample:
            return str(self)
        joined = self.sample.replace(b"\n", b"")
        return f"{self}: {redactor.excerpt(joined, 80)!r}"


# a key whose non-empty string value is generated output: text, reasoning, or a tool call's arguments;
# JSON allows whitespace around the colon (Python servers write ``"content": "``)
_TEXT_KEYS = (b"content", b"text", b"reasoning_content", b"reasoning", b"arguments",
              b"delta", b"partial_json", b"thinking")  # (the last three: Responses' and Messages' own streams)
_TEXT_KEY = rb"(" + rb"|".join(_TEXT_KEYS) + rb')"\s*:\s*"(?!")'  # (after a key's opening quote)


def _first_of(alternatives: tuple[bytes, ...]) -> bytes:
    """A lookahead for the first letters of ``alternatives``. At most of an event's quotes (``"id"``,
    ``"object"``, ``"model"``, ``"index"``, values) it fails at once, where the alternation behind it tries
    each branch in turn: a one-event chunk's scan takes a sixth less time."""
    return rb"(?=[" + bytes(sorted({a[0] for a in alternatives})) + rb"])"


_GENERATED = re.compile(rb'"' + _first_of(_TEXT_KEYS) + _TEXT_KEY)


def text_events_in(block: bytes) -> int:
    """How many events of a (validated) SSE block carry generated output (a non-empty ``content``, ``text``,
    ``reasoning_content``/``reasoning`` or tool-call ``arguments`` string; and, in the agent APIs' own streams, a
    ``delta``, ``partial_json`` or ``thinking`` one).

    A regex over the bytes, no parsing (as cheap as counting, ~0.4 us a block): inside a JSON string a quote
    is escaped, so the pattern only ever matches a key. Role-only chunks (``"content":null``), empty finish
    chunks and usage chunks do not count.
    """
    return len(_GENERATED.findall(block))


def _has_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(v not in (None, "", []) for k, v in delta.items() if k != "role")


def _comment_only(event: bytes) -> bool:
    """Whether every line of ``event`` is a comment."""
    return all(line[:1] == b":" for line in event.split(b"\n"))


def _payload(event: bytes) -> bytes:
    """The data of one event (its ``data:`` lines joined); InvalidStream when a line is not SSE."""
    # ``find`` rather than ``in`` throughout: on CPython 3.11 ``bytes in bytes`` first tries its operand as an
    # int and raises and clears a TypeError, ~0.15 us a test, more than the search itself
    if event.find(b"\n") < 0:
        if event.startswith(b"data:"):
            return event[5:].strip()
        raise InvalidStream("not an SSE data event", event)
    data = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[5:].strip())
        elif not line.startswith((b":", b"event:", b"id:", b"retry:")):
            raise InvalidStream("not an SSE line", line)
    if not data:
        raise InvalidStream("an SSE event without data")
    return b"\n".join(data)


# data that may say something the relay acts on: a usage or timings object (a null one, as SGLang sends in
# every chunk, does not count), or an error. Outside a JSON string only a key is followed by a colon.
_ACTS = (rb'usage"\s*:\s*[^\sn]', rb'timings"\s*:\s*[^\sn]', rb'error"')
_ACTS_KEY = rb"|".join(_ACTS)
_MATTERS = re.compile(rb'"' + _first_of(_ACTS) + rb"(?:" + _ACTS_KEY + rb")")
# both at once, for the one-event block (the common case): one scan instead of two. ``findall`` gives the key of
# each generated-output match (as _GENERATED) and b"" for each match that matters (as _MATTERS).
_SCAN = re.compile(rb'"' + _first_of(_TEXT_KEYS + _ACTS) + rb"(?:" + _TEXT_KEY + rb"|" + _ACTS_KEY + rb")")


# the longest head SSERelay._scan keeps (vLLM's, with a long model name, is ~250 bytes)
_MAX_HEAD = 2048


def _error_message(doc: dict[str, Any]) -> str | None:
    """The message of an upstream error event in any of the shapes engines write one, else None: an ``error``
    object or string (beside ``choices`` too: the OpenAI SDK raises on it there as well; ``"error": null`` beside
    them is no error), the old vLLM ``{"object": "error", "message": ...}``, an agent API's ``{"type": "error"}``."""
    err = doc.get("error")
    if not (err or ("error" in doc and "choices" not in doc) or doc.get("object") == "error"
            or doc.get("type") == "error"):
        return None
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err if err is not None else doc.get("message"))


def _parse(payload: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise InvalidStream("an event that is not JSON", payload) from None
    if not isinstance(doc, dict):
        raise InvalidStream("an event that is not a JSON object", payload)
    return doc


class SSERelay:
    """Feed it upstream bytes; it returns what to send to the client (possibly ``b""``)."""

    __slots__ = ("_acted", "_buf", "_crlf", "_end", "_head", "_head_key", "_hidden", "_idle", "_max_events", "_noise",
                 "_reshape", "_secrets", "_split_usage", "done", "error", "events", "keep_usage", "texts", "timings",
                 "usage")

    def __init__(self, keep_usage: bool, secrets: Redactor | None = None,
                 quirks: StreamQuirks = ALL_QUIRKS, end: re.Pattern[bytes] | None = None,
                 reshape_error: Callable[[bytes], bytes] | None = None,
                 hidden: Sequence[FieldPath] = (), max_events: int = 1 << 40) -> None:
        self.keep_usage = keep_usage
        # the most data events the request may be sent: an engine sends at most one a token it generates, and a
        # few of its own (role, finish, usage); past it the engine is not generating, and the stream is cut (a
        # request of max_tokens 5 was relayed 146 MB of one-character events, every other key's p50 from 8 ms to
        # 1.2 s while it lasted, sweep 27)
        self._max_events = max_events
        self._hidden = hidden  # fields removed from the events (only usage and timings events carry them)
        self._end = end  # an agent API's own last event (its streams have no [DONE]); None: OpenAI's [DONE]
        # an upstream error event's data in the shape the client expects (OpenAI's envelope, secrets scrubbed):
        # engines write their own (llama.cpp a numeric code and no param, TabbyAPI a trace); None: as it came,
        # scrubbed with ``secrets``
        self._reshape = reshape_error
        self._crlf = quirks.crlf
        self._split_usage = quirks.usage_with_choices
        self._secrets = secrets  # the backend's address and credentials, taken out of the events it echoes them in
        self._buf = bytearray()  # (a partial event: grown in place, searched only where it grew)
        self._idle = 0  # bytes of comments, blank lines and events without text since the last with text
        self._noise = 0  # the same in the whole stream (MAX_NOISE_BYTES)
        self._acted = 0  # bytes of large events parsed (see MAX_ACTED_BYTES)
        self._head = b""  # a one-event chunk's bytes to its first match, generated text (see _scan)
        self._head_key = b""  # that match's key
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.error: str | None = None  # message of an error event the upstream sent mid-stream
        self.done = False  # saw data: [DONE] (or the ``end`` event)
        self.events = 0  # data events seen (comments are not counted)
        # what the last ``feed`` returned, counted as text_events_in counts, where the relay counted it on the
        # way (one whole event passed unchanged); None: count it yourself
        self.texts: int | None = None

    def feed(self, data: bytes) -> bytes:
        self.texts = None
        if self.done:  # (nothing comes after the end: dropped, and bounded as noise; 62 MB were relayed, sweep 28)
            self._idled(len(data))
            return b""
        if self._buf:
            grown = len(self._buf)
            self._buf += data
            # (only where it grew: joined and searched whole at every read, one 1 MB event in 256-byte reads took
            # 1.5 s of the event loop, sweep 28)
            if (self._buf.find(b"\n\n", max(grown - 2, 0)) < 0
                    and (not self._crlf or self._buf.find(b"\n\r\n", max(grown - 3, 0)) < 0)):
                if len(self._buf) > MAX_PENDING_BYTES:
                    raise InvalidStream(f"{len(self._buf)} bytes without the end of an SSE event")
                return b""
            data = bytes(self._buf)
            self._buf = bytearray()
        if self._crlf and data.find(b"\r") >= 0:
            data = data.replace(b"\r\n", b"\n")
        if data[-3:] == b"}\n\n" and data[:7] == b"data: {" and data.find(b"\n") == len(data) - 2:
            # one whole one-line event, nothing left over: the common case (one event per upstream read),
            # with the fewest steps (slices compared: ``endswith`` and ``startswith`` parse their arguments the
            # slow way on CPython 3.11, ~0.25 us a call here)
            self.events += 1
            if self.events > self._max_events:
                raise InvalidStream(f"more than {self._max_events} events, more than the request may generate")
            if self._end is not None and self._end.search(data) is not None:
                self.done = True
            found = self._scan(data)
            if any(found):
                self._idle = 0
            else:  # (no text: as a comment is, else `data: {}` unpaced held every other key's requests seconds)
                self._idled(len(data))
            if b"" not in found:  # nothing that matters: the event passes, and its text events are counted
                self.texts = len(found)
                return data
            new = self._act(data[6:-2])
            return data if new is None else b"".join(e + b"\n\n" for e in new)
        if data.endswith(b"\n\n"):
            return self._relay(data)
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > MAX_PENDING_BYTES:
                raise InvalidStream(f"{len(data)} bytes without the end of an SSE event")
            self._buf = bytearray(data)
            return b""
        self._buf = bytearray(data[end + 2 :])
        return self._relay(data[: end + 2])

    def _scan(self, data: bytes) -> list[bytes]:
        """``_SCAN.findall(data)`` for one event of the usual form (``data: {...}``, with or without its blank line),
        with the scan of the head its stream repeats skipped.

        An engine's chunks differ little: vLLM's and SGLang's repeat everything before the generated text
        (``data: {"id":...,"object":...,"created":...,"model":...,"choices":[{"index":0,"delta":{"content":"``),
        whose ~20 quotes are most of the scan. So the bytes up to the end of a chunk's first match, when that is
        generated text, are kept (``_head``, up to ``_MAX_HEAD`` bytes). A chunk that starts with them has the same
        first match, provided its value is not empty (the match's ``(?!")`` reads one byte past the head): no
        attempt at an earlier quote reads past the match's own first quote (an attempt stops at the next quote
        after its key at the latest). The scan goes on after it, as findall would: the same list, for half the
        time on such chunks. Anything else is scanned whole, and its head kept for the next."""
        head = self._head
        n = len(head)
        if n and data[:n] == head and data[n] != 34:  # (34: '"'; data is longer: the head ends with '"', data with '}')
            found = _SCAN.findall(data, n)
            found.insert(0, self._head_key)
            return found
        m = _SCAN.search(data)
        if m is None:
            return []
        key = m[1] or b""  # (b"": a match that matters, as findall gives it)
        end = m.end()
        if key and end <= _MAX_HEAD:
            self._head, self._head_key = data[:end], key
        found = _SCAN.findall(data, end)
        found.insert(0, key)
        return found

    def flush(self) -> bytes:
        """What the upstream left without a closing blank line, checked like any event and, as a cut
        connection shows there, parsed in full."""
        rest, self._buf = bytes(self._buf).strip(), bytearray()
        if not rest:
            return b""
        if not rest.startswith(b":"):
            payload = _payload(rest)
            if payload != b"[DONE]":
                _parse(payload)
        return self._relay(rest + b"\n\n")

    def _relay(self, block: bytes) -> bytes:
        """``block``: whole events, ending with a blank line. Events of the usual form (one ``data: {...}`` line)
        are checked as ``feed`` checks a one-event chunk, inline; while every event passes unchanged, their text
        events are counted on the way (``texts``), as for one event."""
        out: list[bytes] = []
        changed = False
        texts: int | None = 0
        events = block.split(b"\n\n")
        events.pop()  # the b"" after the last blank line
        for event in events:
            if event[:7] == b"data: {" and event[-1:] == b"}" and event.find(b"\n") < 0:  # the usual form
                self.events += 1
                if self.events > self._max_events:
                    raise InvalidStream(f"more than {self._max_events} events, more than the request may generate")
                if self._end is not None and self._end.search(event) is not None:
                    self.done = True
                found = self._scan(event)
                if any(found):
                    self._idle = 0
                else:  # (no text: counted as a comment is)
                    self._idled(len(event) + 2)
                if b"" not in found:
                    out.append(event)
                    if texts is not None:
                        texts += len(found)
                    continue
                texts = None  # (an event that matters: what is sent is counted by the caller)
                new = self._act(event[6:])
            elif event == b"data: [DONE]":
                self.events += 1
                self.done = True
                out.append(event)
                continue
            elif not event:  # an extra blank line: dropped
                self._idled(2)
                changed = True
                continue
            elif event[:1] == b":" and _comment_only(event):
                self._idled(len(event) + 2)
                texts = None
                if event != b": ping":  # (what it said is no one's business: see the module docstring)
                    changed = True
                out.append(b": ping")
                continue
            else:
                texts = None
                if _GENERATED.search(event) is not None:  # (another form: an agent API's `event:` lines, ...)
                    self._idle = 0
                else:  # (without text, counted as a comment is: an `event: x` flood held every request, sweep 28)
                    self._idled(len(event) + 2)
                new = self._event(event)
            if new is None:
                out.append(event)
            else:
                out.extend(new)
                changed = True
        self.texts = texts
        if not changed:
            return block  # every event passed unchanged: forward the bytes as they came
        return b"".join(e + b"\n\n" for e in out)

    def _idled(self, size: int) -> None:
        self._idle += size
        self._noise += size
        if self._noise > MAX_NOISE_BYTES:
            raise InvalidStream(f"more than {MAX_NOISE_BYTES} bytes of comments, blank lines and events without text "
                                "in the stream")
        if self._idle > MAX_IDLE_BYTES:
            raise InvalidStream(f"more than {MAX_IDLE_BYTES} bytes of comments, blank lines and events without text "
                                "between two that have it")

    def _fields(self, event: bytes) -> bytes | None:
        """``event`` with its comment lines dropped and its other fields scrubbed of the credentials, or None when
        it has neither (as it should)."""
        lines = event.split(b"\n")
        kept = [line for line in lines if line[:1] != b":"]
        secrets = self._secrets
        fields = [line for line in kept if not line.startswith(b"data:")]
        if fields and secrets is not None and secrets.echoed(b"\n".join(fields)):
            kept = [line if line.startswith(b"data:") else secrets.scrub(line.decode("utf-8", "replace")).encode()
                    for line in kept]
        return None if kept == lines else b"\n".join(kept)

    def _event(self, event: bytes) -> list[bytes] | None:
        """Check one data event not of the usual form (several lines, other fields, spacing): None when it passes
        unchanged, else the events to send instead."""
        self.events += 1
        if self.events > self._max_events:
            raise InvalidStream(f"more than {self._max_events} events, more than the request may generate")
        payload = _payload(event)
        cleaned = self._fields(event)
        if cleaned is not None:
            new = self._checked(cleaned, payload)
            return [cleaned] if new is None else new
        return self._checked(event, payload)

    def _checked(self, event: bytes, payload: bytes) -> list[bytes] | None:
        if payload.startswith(b"{") and payload.endswith(b"}"):
            if self._end is not None and self._end.search(payload) is not None:
                self.done = True
            if _MATTERS.search(payload) is None:
                return None
            new = self._act(payload)
            if not new:
                return new
            # its other fields go with what replaces it: an agent API's client dispatches on ``event:`` (the
            # Anthropic SDK ignores an error or a message_delta without its ``event:`` line)
            fields = b"\n".join(line for line in event.split(b"\n") if not line.startswith(b"data:"))
            return [fields + b"\n" + e for e in new] if fields else new
        if payload == b"[DONE]":
            self.done = True
            return None
        raise InvalidStream("an event that is not a JSON object", payload)

    def _act(self, payload: bytes) -> list[bytes] | None:
        """An event that may carry usage, timings or an error: parsed, noted, and rewritten where needed."""
        if len(payload) > BIG_ACTED_BYTES:
            self._acted += len(payload)
            if self._acted > MAX_ACTED_BYTES:
                raise InvalidStream(f"more than {MAX_ACTED_BYTES} bytes of events of over {BIG_ACTED_BYTES} bytes "
                                    "that say usage, timings or an error")
        doc = _parse(payload)
        message = _error_message(doc)
        if message is not None:
            self.error = message
            if self._reshape is not None and not doc.get("choices"):
                return [b"data: " + self._reshape(payload)]
        secrets = self._secrets
        # an error's every string (it may name the backend's address too), else the credentials where the bytes
        # may hold one (a look in C first: a usage event rarely does)
        scrubbed = secrets is not None and (secrets.scrub_json(doc, address=True) if message is not None else
                                            secrets.echoed(payload) and secrets.scrub_json(doc))
        timings = doc.get("timings")
        if isinstance(timings, dict):
            self.timings = timings
        shown = without(doc, self._hidden) if self._hidden else None  # (None: nothing hidden in it)
        if shown is None and scrubbed:
            shown = doc
        usage = doc.get("usage")
        if not isinstance(usage, dict):
            return None if shown is None else [b"data: " + orjson.dumps(shown)]
        self.usage = usage
        choices = doc.get("choices")
        if not choices:
            if not self.keep_usage:
                return []
            return None if shown is None else [b"data: " + orjson.dumps(shown)]
        if not self._split_usage:  # not this engine's habit: an ordinary chunk that also says usage
            return None if shown is None else [b"data: " + orjson.dumps(shown)]
        # a usage chunk that also carries choices: split it
        doc = shown if shown is not None else doc
        content = {k: v for k, v in doc.items() if k != "usage"}
        out = []
        if any(_has_content(c) for c in choices):
            out.append(b"data: " + orjson.dumps(content))
        if self.keep_usage:
            out.append(b"data: " + orjson.dumps({**content, "choices": [], "usage": doc["usage"]}))
        return out
