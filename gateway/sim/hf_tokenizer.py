"""The emulators' Hugging Face tokenizer: what vLLM and SGLang do with a model directory's tokenizer files.

Loading (``transformers``' layout): ``tokenizer.json`` with the ``tokenizers`` library; the chat template from
``chat_template.jinja`` if present, else ``tokenizer_config.json["chat_template"]`` (a string, or a list of
``{name, template}`` of which the ``default`` one); the special tokens as strings (an ``AddedToken`` mapping
gives its ``content``).

Rendering, as ``transformers``' ``apply_chat_template``: the template compiled in
``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with
``jinja2.ext.loopcontrols`` and a no-op ``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII,
``raise_exception`` and ``strftime_now`` globals; rendered with ``messages``, ``tools``,
``add_generation_prompt`` (True unless the request says otherwise), the special tokens and the request's
``chat_template_kwargs``. Before that the request is prepared as vLLM's OpenAI server prepares it
(``chat_utils.parse_chat_messages``, ``serving_chat``): content given as parts becomes its text parts joined
with newlines (templates that take string content), missing content ``""``; an assistant's ``tool_calls``
arguments are parsed from their JSON string (empty: ``{}``), an empty ``tool_calls`` list dropped; each tool is
the pydantic dump of ``{"type", "function": {"name", "description", "parameters", ...}}`` (so an absent
``description`` renders as ``null``); SGLang's dialect passes each tool's ``function`` dump instead
(``{"description", "name", "parameters", "strict"}``), and no tools with ``tool_choice: "none"``.

Token ids: a chat prompt is the rendered text tokenized *without* added special tokens (the template writes
BOS); a completion prompt *with* them. Written apart from the gateway's own tokenizing
(``gateway/kvcache/tokenizer.py``), whole-text and uncached, so tests compare two implementations.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer

Dialect = Literal["vllm", "sglang"]
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (training templates mark assistant turns with it): renders its
    body unchanged, as ``transformers`` does when it is not collecting assistant masks."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The jinja environment of ``transformers``' ``_cached_compile_jinja_template``."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template
                         if isinstance(t, Mapping) and t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _content_text(content: Any) -> Any:
    """vLLM's "string" content format: the text parts joined with newlines; no content: an empty string."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(str(p["text"]) for p in content
                         if isinstance(p, Mapping) and p.get("type", "text") in ("text", "input_text") and "text" in p)
    return content


def _tool_calls(calls: list[Any]) -> list[Any]:
    out = []
    for call in calls:
        if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping):
            fn = dict(call["function"])
            args = fn.get("arguments")
            if not args:
                fn["arguments"] = {}
            elif not isinstance(args, dict | list):
                with contextlib.suppress(TypeError, ValueError):  # vLLM answers 400; the emulator keeps the string
                    fn["arguments"] = json.loads(args)
            call = {**call, "function": fn}
        out.append(call)
    return out


def prepare_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The conversation as vLLM hands it to the template (``ConversationMessage``)."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        prepared: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"))}
        calls = message.get("tool_calls")
        if role == "assistant" and isinstance(calls, list) and calls:
            prepared["tool_calls"] = _tool_calls(calls)
        if role == "tool" and "tool_call_id" in message:
            prepared["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            prepared["name"] = message["name"]
        out.append(prepared)
    return out


def prepare_tools(tools: Any, dialect: Dialect = "vllm", tool_choice: Any = None) -> list[Any] | None:
    """The request's tools as the engine hands them to the template: vLLM ``[tool.model_dump() for tool in
    request.tools]`` (``{"type", "function": {"name", "description", "parameters", ...extra}}``, defaults filled
    in); SGLang ``[tool.function.model_dump() ...]`` (``{"description", "name", "parameters", "strict"}``), and
    none at all with ``tool_choice: "none"``."""
    if not isinstance(tools, list) or (dialect == "sglang" and (not tools or tool_choice == "none")):
        return None
    out: list[Any] = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping):
            out.append(tool)
            continue
        if dialect == "sglang":
            out.append({"description": fn.get("description"), "name": fn.get("name"),
                        "parameters": fn.get("parameters"), "strict": bool(fn.get("strict", False))})
            continue
        dumped = {"name": fn.get("name"), "description": fn.get("description"), "parameters": fn.get("parameters"),
                  **{k: v for k, v in fn.items() if k not in ("name", "description", "parameters")}}
        out.append({"type": tool.get("type", "function"), "function": dumped,
                    **{k: v for k, v in tool.items() if k not in ("type", "function")}})
    return out


class HFTokenizer:
    """One model's tokenizer and chat template, loaded with :meth:`from_dir`; ``dialect``: whose request
    preparation to follow (:func:`prepare_tools`)."""

    def __init__(self, tokenizer: Tokenizer, template: str | None, special: Mapping[str, str],
                 model_max_length: int | None = None, dialect: Dialect = "vllm") -> None:
        self.tokenizer = tokenizer
        self.dialect: Dialect = dialect
        self.template = environment().from_string(template) if template else None
        self.special = dict(special)
        self.model_max_length = model_max_length
        eos = self.special.get("eos_token")
        self.eos_id: int | None = tokenizer.token_to_id(eos) if eos else None

    @classmethod
    def from_dir(cls, directory: Path | str, dialect: Dialect = "vllm") -> HFTokenizer:
        directory = Path(directory)
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        special = {name: text for name in SPECIAL_NAMES if (text := _token_text(config.get(name))) is not None}
        max_len = config.get("model_max_length")
        return cls(tokenizer, _template_source(directory, config), special,
                   max_len if isinstance(max_len, int) else None, dialect)

    # -- prompts ----------------------------------------------------------------------------------------------
    def render(self, messages: Sequence[Any], tools: Any = None, add_generation_prompt: bool = True,
               tool_choice: Any = None, **kwargs: Any) -> str:
        """The chat prompt's text. Raises ``jinja2.TemplateError`` when the template refuses the request (or
        ``ValueError`` when the model has no chat template)."""
        if self.template is None:
            raise ValueError("this model has no chat template")
        variables = {**self.special, **kwargs, "messages": prepare_messages(messages),
                     "tools": prepare_tools(tools, self.dialect, tool_choice),
                     "add_generation_prompt": add_generation_prompt}
        return self.template.render(**variables)

    def render_request(self, body: Mapping[str, Any]) -> str:
        """A chat request body's prompt text: its messages, tools, ``add_generation_prompt`` and
        ``chat_template_kwargs``."""
        extra = body.get("chat_template_kwargs")
        kwargs = {k: v for k, v in extra.items() if isinstance(k, str)} if isinstance(extra, dict) else {}
        return self.render(body.get("messages") or [], body.get("tools"),
                           bool(body.get("add_generation_prompt", True)), body.get("tool_choice"), **kwargs)

    def chat_ids(self, messages: Sequence[Any], tools: Any = None, **kwargs: Any) -> list[int]:
        return self.encode(self.render(messages, tools, **kwargs), add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- generated text ---------------------------------------------------------------------------------------
    def pieces(self, text: str) -> tuple[list[str], list[int]]:
        """``text`` as this tokenizer's tokens, one text piece per token, the pieces concatenating to ``text``.
        A character split over several byte-level tokens is given to the last of them (earlier ones get
        ``""``), as an engine's detokenizer emits it once complete."""
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        pieces: list[str] = []
        pos = 0
        for i, (_, end) in enumerate(enc.offsets):
            last_of_char = i + 1 == len(ids) or enc.offsets[i + 1][1] != end
            if last_of_char and end > pos:
                pieces.append(text[pos:end])
                pos = end
            else:
                pieces.append("")
        if pieces and pos < len(text):  # trailing text no token claimed (cannot happen with byte-level BPE)
            pieces[-1] += text[pos:]
        return pieces, ids
