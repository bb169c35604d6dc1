"""Chat template: renders OpenAI chat messages (roles, text parts, tools, tool calls) to one prompt string.

Llama 2 chat layout, so that a conversation's later turns extend its earlier prompt (prefix caching pays):
``[INST] <<SYS>>\\n{system and tool list}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s><s>[INST] ...``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts, joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def render_chat(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> str:
    system_parts = [content_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")]
    if tools:
        system_parts.append("Tools:\n" + "\n".join(orjson.dumps(t).decode() for t in tools))
    out: list[str] = []
    sys_block = "<<SYS>>\n" + "\n".join(system_parts) + "\n<</SYS>>\n\n" if system_parts else ""
    first_user = True
    for m in messages:
        role = m.get("role")
        text = content_text(m.get("content"))
        if role == "user" or role == "tool":
            prefix = sys_block if first_user else ""
            first_user = False
            tag = "" if role == "user" else "[tool result] "
            out.append(f"<s>[INST] {prefix}{tag}{text} [/INST]")
        elif role == "assistant":
            calls = m.get("tool_calls")
            if calls:
                text += " " + orjson.dumps(calls).decode()
            out.append(f" {text} </s>")
    return "".join(out)
