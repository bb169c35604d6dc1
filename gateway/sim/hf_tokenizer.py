"""The emulators' Hugging Face tokenizer path: what vLLM and SGLang do with a model directory.

``transformers``' ``apply_chat_template`` renders the chat template in
``jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with
``jinja2.ext.loopcontrols``, a ``tojson`` filter that keeps non-ASCII, and ``raise_exception`` /
``strftime_now``; the special tokens are template variables; the rendered text is tokenized without added
special tokens (the template writes BOS). Completion prompts are tokenized with them. Content given as parts
is joined with newlines (vLLM, for templates that take string content).

Written apart from the gateway's own tokenizing (``gateway/kvcache/tokenizer.py``), whole-text and
uncached, so the parity tests compare two implementations.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer


def _special(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    def __init__(self, tokenizer: Tokenizer, template: str, special: dict[str, str]) -> None:
        self.tokenizer = tokenizer
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols])

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template)
        self.special = special

    @classmethod
    def from_dir(cls, directory: Path | str) -> HFTokenizer:
        directory = Path(directory)
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text())
        template_file = directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):
            template = next(t["template"] for t in template if t.get("name") == "default")
        special = {k: v for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if (v := _special(config.get(k))) is not None}
        return cls(tokenizer, template or "", special)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
               add_generation_prompt: bool = True) -> str:
        normalized = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                content = "\n".join(p["text"] for p in content if isinstance(p, Mapping) and "text" in p)
            normalized.append({**message, "content": content})
        return self.template.render(messages=normalized, tools=tools, add_generation_prompt=add_generation_prompt,
                                    **self.special)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> list[int]:
        return list(self.tokenizer.encode(self.render(messages, tools), add_special_tokens=False).ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
