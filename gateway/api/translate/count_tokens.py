"""``/v1/messages/count_tokens`` answered by an engine that only tokenizes (TabbyAPI's ``/v1/token/encode``).

The engine renders a list of chat messages through the model's own chat template and tokenizer, so what it
counts is the count, not an estimate: the request is the Messages request's chat translation (system, turns,
tool calls and results, as generation sees them), each message's content as one string, as the engine's chat
path joins text parts before rendering.

What its template does not render there, and how it is counted instead:

- **tools**: the encode route fills the template's ``messages`` only, never its ``tools``. Their definitions, as
  the chat request carries them (one JSON object per tool, a line each), are appended to the system message
  (one is made when there is none), where chat templates put the tool list, and counted with it: the model's
  tokenizer on the tools' own JSON. Not counted: the template's fixed words around a tool list (Qwen's
  "# Tools ... <tools></tools>" preamble, some tens of tokens), which no route of the engine renders.
- **the generation prompt** (``add_generation_prompt`` is false there): a few tokens, not counted.
- **images**: not rendered, so a request with an image is not counted here (routing sends it to an engine
  that counts it, or refuses it).
- the beginning-of-sequence token: the engine's default (``add_bos_token: true``); where the template writes
  one too, the count is one over, never under.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.engines.readings import MAX_USAGE_TOKENS


def countable(chat: dict[str, Any]) -> bool:
    """Whether the engine's tokenizing route can count this chat request: no image (its content is text)."""
    return all(not isinstance(m.get("content"), list) or all(p.get("type") == "text" for p in m["content"])
               for m in chat.get("messages") or ())


def _text(content: Any) -> Any:
    if isinstance(content, list):  # (text parts only: see countable)
        return "".join(str(part.get("text") or "") for part in content)
    return content


def encode_request(chat: dict[str, Any]) -> dict[str, Any]:
    """The tokenizing request for a count_tokens request's chat translation (see the module's docstring)."""
    messages = [{**m, "content": _text(m.get("content"))} for m in chat.get("messages") or ()]
    tools = chat.get("tools")
    if tools:
        listed = "\n".join(orjson.dumps(tool).decode() for tool in tools)
        if messages and messages[0].get("role") == "system":
            system = messages[0].get("content") or ""
            messages[0] = {**messages[0], "content": f"{system}\n{listed}" if system else listed}
        else:
            messages.insert(0, {"role": "system", "content": listed})
    return {"text": messages, "add_bos_token": True}


def input_tokens(raw: bytes) -> bytes:
    """The engine's ``{"tokens": [...], "length": N}`` as Anthropic's ``{"input_tokens": N}``; a ValueError for
    an answer without a count."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ValueError("not JSON") from None
    length = doc.get("length") if isinstance(doc, dict) else None
    if isinstance(doc, dict) and length is None and isinstance(doc.get("tokens"), list):
        length = len(doc["tokens"])
    if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= MAX_USAGE_TOKENS:
        raise ValueError("no token count ('length'), or one past any prompt")
    return orjson.dumps({"input_tokens": length})
