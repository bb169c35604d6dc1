"""A request's prompt as the engine's token ids: the served model's chat template, rendered as the engines
render it, then its tokenizer.

vLLM and SGLang render chat requests with transformers' ``apply_chat_template``: jinja2's
``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with ``loopcontrols``, a ``tojson``
filter that keeps non-ASCII, ``raise_exception`` and ``strftime_now`` globals, the tokenizer's special tokens
as variables, ``add_generation_prompt=True``, and then tokenize the text *without* adding special tokens (the
template writes them); completion prompts are tokenized *with* them. Message content given as parts is joined
with newlines, as vLLM does for templates that take string content; an assistant's tool-call arguments are
parsed from their JSON and tools dumped as vLLM's models dump them. A mismatch (a template feature rendered
differently) costs routing quality only: the request still goes to a healthy backend.

Cost is bounded: at most ``max_chars`` characters of message content are rendered (a longer prompt is routed
on its first ``max_chars``), and text between special tokens is tokenized once and cached (a system prompt or
an earlier turn shared by many requests is tokenized once); both are measured in ``gateway bench routing
kv-events``.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

DEFAULT_MAX_CHARS = 64 * 1024
MIN_TAIL = 16  # tokens dropped after a cut: the cut word tokenizes differently from the whole one
CACHE_TOKENS = 2_000_000  # token ids kept in the segment cache (about 16 MB)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_SELF_CHECK = "Hello world, {x}! 12 34\n  tabs\tand spaces  "


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):  # an AddedToken dict
        return str(value["content"])
    return None


def _template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _content(content: Any) -> Any:
    """vLLM's "string" content format: text parts joined with newlines; no content: an empty string."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(str(p["text"]) for p in content if isinstance(p, Mapping)
                         and p.get("type", "text") in ("text", "input_text") and "text" in p)
    return content


def _tool_calls(calls: list[Any]) -> list[Any]:
    """An assistant's tool calls with their arguments parsed from JSON (empty: ``{}``), as vLLM passes them."""
    out = []
    for call in calls:
        if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
            function = dict(call["function"])
            arguments = function.get("arguments")
            if not arguments:
                function["arguments"] = {}
            elif isinstance(arguments, str):
                with contextlib.suppress(ValueError):  # not JSON: vLLM refuses the request; kept as it is
                    function["arguments"] = json.loads(arguments)
            call = {**call, "function": function}
        out.append(call)
    return out


def _message(raw: Any) -> dict[str, Any] | None:
    """One message as vLLM's chat preprocessing leaves it: role, content as text, an assistant's tool calls,
    a tool result's call id, a name."""
    if not isinstance(raw, Mapping):
        return None
    role = raw.get("role")
    message: dict[str, Any] = {"role": role, "content": _content(raw.get("content"))}
    calls = raw.get("tool_calls")
    if role == "assistant" and isinstance(calls, list) and calls:
        message["tool_calls"] = _tool_calls(calls)
    if role == "tool" and "tool_call_id" in raw:
        message["tool_call_id"] = raw["tool_call_id"]
    if isinstance(raw.get("name"), str):
        message["name"] = raw["name"]
    return message


def _tools(tools: Any) -> list[Any] | None:
    """Tools as vLLM's pydantic models dump them: type, then function name, description, parameters (absent
    ones as null), other fields after."""
    if not isinstance(tools, list):
        return None
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            out.append(tool)
            continue
        function = tool["function"]
        out.append({"type": tool.get("type", "function"),
                    "function": {"name": function.get("name"), "description": function.get("description"),
                                 "parameters": function.get("parameters"),
                                 **{k: v for k, v in function.items()
                                    if k not in ("name", "description", "parameters")}},
                    **{k: v for k, v in tool.items() if k not in ("type", "function")}})
    return out


class PromptTokenizer:
    """One model's chat template and tokenizer. ``chat`` and ``completion`` return the prompt's token ids, or
    None when the template refuses the request (the caller then routes without them)."""

    def __init__(self, tokenizer: Tokenizer, template: str | None, special: Mapping[str, str], *,
                 max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self._tokenizer = tokenizer
        self._template = _environment().from_string(template) if template else None
        self._special = dict(special)
        self.max_chars = max_chars
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached_tokens = 0
        self.cache_hits = 0
        self.cache_misses = 0
        # split on special added tokens that take no surrounding whitespace: text between them tokenizes
        # alone exactly as within the whole (tokenizers splits on added tokens before anything else)
        added = [t for t in tokenizer.get_added_tokens_decoder().values()
                 if t.special and not t.lstrip and not t.rstrip and not t.normalized]
        self._special_ids = {t.content: tokenizer.token_to_id(t.content) for t in added}
        self._split = (re.compile("(" + "|".join(re.escape(t) for t in sorted(self._special_ids, key=len,
                                                                             reverse=True)) + ")")
                       if self._special_ids else None)
        if self._split is not None and not self._segments_agree():
            self._split = None  # this tokenizer's normalizer or pre-tokenizer looks across added tokens

    @classmethod
    def from_dir(cls, directory: Path, *, max_chars: int = DEFAULT_MAX_CHARS) -> PromptTokenizer:
        """A Hugging Face model directory: ``tokenizer.json``, and ``tokenizer_config.json`` (chat template,
        special tokens) or ``chat_template.jinja``."""
        try:
            tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise TokenizerError(f"{directory}: cannot load tokenizer.json: {exc}") from None
        config_file = directory / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{config_file}: {exc}") from None
        special = {name: text for name in SPECIAL_NAMES if (text := _token_text(config.get(name))) is not None}
        try:
            return cls(tokenizer, _template_source(directory, config), special, max_chars=max_chars)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"{directory}: chat template does not compile: {exc}") from None

    def _segments_agree(self) -> bool:
        text = "".join(f"{_SELF_CHECK}{s}" for s in self._special_ids) + _SELF_CHECK
        whole = self._tokenizer.encode(text, add_special_tokens=False).ids
        return whole == self._encode_segments(text)

    # -- prompts ----------------------------------------------------------------------------------------------
    def chat(self, body: Mapping[str, Any]) -> list[int] | None:
        if self._template is None:
            return None
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        messages, truncated = self._bounded(messages)
        kwargs = body.get("chat_template_kwargs")
        extra = {k: v for k, v in kwargs.items() if isinstance(k, str)} if isinstance(kwargs, dict) else {}
        generation = body.get("add_generation_prompt", True) is not False and not truncated
        try:
            text = self._template.render(**{**extra, **self._special, "messages": messages,
                                            "tools": _tools(body.get("tools")), "add_generation_prompt": generation})
        except Exception:  # the template refused (raise_exception) or broke on unexpected input
            return None
        ids = self._encode_segments(text)
        return ids[:-MIN_TAIL] if truncated else ids

    def completion(self, prompt: Any) -> list[int] | None:
        if not isinstance(prompt, str):
            return None
        truncated = len(prompt) > self.max_chars
        ids = self._tokenizer.encode(prompt[: self.max_chars], add_special_tokens=True).ids
        return ids[:-MIN_TAIL] if truncated else ids

    def _bounded(self, messages: list[Any]) -> tuple[list[dict[str, Any]], bool]:
        """The messages as vLLM hands them to the template (:func:`_message`), cut to ``max_chars`` of
        content."""
        budget = self.max_chars
        out: list[dict[str, Any]] = []
        for raw in messages:
            message = _message(raw)
            if message is None:
                continue
            content = message["content"]
            size = len(content) if isinstance(content, str) else 0
            if size > budget:
                out.append({**message, "content": content[:budget]})
                return out, True
            budget -= size
            out.append(message)
        return out, False

    def _encode_segments(self, text: str) -> list[int]:
        if self._split is None:
            return self._cached(text)
        ids: list[int] = []
        special = self._special_ids
        for piece in self._split.split(text):
            if not piece:
                continue
            sid = special.get(piece)
            if sid is not None:
                ids.append(sid)
            else:
                ids.extend(self._cached(piece))
        return ids

    def _cached(self, text: str) -> list[int]:
        cache = self._cache
        ids = cache.get(text)
        if ids is not None:
            cache.move_to_end(text)
            self.cache_hits += 1
            return ids
        self.cache_misses += 1
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        cache[text] = ids
        self._cached_tokens += len(ids)
        while self._cached_tokens > CACHE_TOKENS and cache:
            _, dropped = cache.popitem(last=False)
            self._cached_tokens -= len(dropped)
        return ids

