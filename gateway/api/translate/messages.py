"""Anthropic Messages API <-> chat completions: requests, answers, stream events and error bodies.

``POST /v1/messages`` (the ``anthropic`` SDK, Claude Code) becomes a chat completions request every engine
serves; its answer and each of its stream chunks are turned back into a Message and Anthropic stream events.
Pure: no I/O, no framework.

What a request may say is decided field by field (``_MESSAGES_FIELDS``, ``_COUNT_FIELDS``); whatever cannot be
honoured faithfully is refused with a 400 naming it (``param`` is the field's path, e.g.
``messages[2].content[0]``), never dropped. The decisions that are not obvious:

* ``thinking`` blocks of earlier assistant turns become that chat message's ``reasoning_content``: the way
  chat clients send reasoning back, read by llama.cpp, vLLM and SGLang (as :mod:`.responses` does for
  reasoning items). The chat template then does what it does for any chat client: most drop the reasoning of
  earlier turns, interleaved-thinking templates keep it within a tool-calling turn. Their ``signature`` only
  proves that Claude wrote them and means nothing to an engine. ``redacted_thinking`` blocks are dropped:
  their ``data`` is Claude's encrypted reasoning, which no other model can read (this gateway never emits one).
* ``context_management`` is accepted when its edits are all ``clear_thinking_20251015`` (Claude Code sends
  ``keep: "all"``): the reasoning of all but the last ``keep`` assistant turns is left out, as Anthropic does.
  Other edits (clearing tool results, compaction) are refused.
* ``thinking``: ``enabled`` and ``adaptive`` become ``chat_template_kwargs: {"enable_thinking": true,
  "thinking": true}`` (what Qwen3- and DeepSeek-style templates read on vLLM, SGLang and llama.cpp),
  ``disabled`` the same with false; absent leaves the template's default. ``budget_tokens`` is a budget, not a
  promise (Anthropic's models may think less) and no chat request can enforce it; ``max_tokens`` still bounds
  reasoning plus answer, as on Anthropic. ``display: "omitted"`` is honoured on the way back: thinking blocks
  come with empty text, as Anthropic returns them (the model still reasons). ``between_tools`` is refused.
* ``defer_loading`` on a tool (tool search: Claude Code's ``advanced-tool-use`` beta) keeps it out of the
  model's tools until a ``tool_reference`` block in a tool result names it, as Anthropic does; such a
  reference becomes the line ``Tool loaded: <name>`` in that result.
* ``cache_control`` (top level and on any block or tool) is a caching hint: it never changes the output, and
  engines cache prefixes on their own (the gateway's prefix-aware routing acts on them). It is ignored.
* A ``tool_result`` with ``is_error: true`` becomes a tool message whose content starts with ``"Error: "``:
  chat has no error flag, and the model should still learn that the tool failed. Images in tool results are
  refused (chat tool messages carry text).
* A conversation ending in an assistant turn with text is a prefill: the chat request asks the engine to
  continue that message (``continue_final_message``, ``add_generation_prompt: false``; vLLM and SGLang read
  them, llama.cpp continues a final assistant message on its own).
* ``output_config.format`` becomes a strict ``json_schema`` response format; ``output_config.effort``
  low/medium/high becomes ``reasoning_effort`` (xhigh/max have no chat equivalent and are refused).
* ``service_tier`` and ``speed: "standard"`` ask for nothing an engine does differently and are accepted;
  ``container``, ``mcp_servers``, server tools, Anthropic-defined tools, documents, search results, files,
  citations, ``inference_geo`` and the rest are refused.
* Several text blocks of one turn are joined with ``"\\n"`` (what vLLM does with several text parts); a turn
  with images keeps chat content parts.

Answers: ``reasoning_content`` (or ``reasoning``: engines differ) becomes a ``thinking`` block with an empty
signature, before the text; tool calls become ``tool_use`` blocks (arguments that are not a JSON object are
kept as ``{"_raw": text}``, and such an input is sent back as that text, so the model sees what it wrote).
Engines do not say which stop sequence matched, except vLLM (``stop_reason``) and SGLang (``matched_stop``):
with one of them the stop reason is ``stop_sequence``, else ``end_turn``. ``usage.input_tokens`` counts the
prompt tokens not read from the cache (Anthropic's total input is input + cache read + cache creation).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

import orjson

from gateway.api.translate.ending import Ending
from gateway.api.translate.figures import details, token_count
from gateway.errors import GatewayError

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
    404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error",
}
_ANTHROPIC_ERROR_TYPES = frozenset(_ERROR_TYPES.values())
_STOP_REASONS = {"length": "max_tokens", "content_filter": "refusal", "tool_calls": "tool_use",
                 "function_call": "tool_use"}
_MATCHED_STOP = ("stop_reason", "matched_stop")  # where vLLM and SGLang say which stop string ended the answer
_HARMLESS: tuple[Any, ...] = ([], {}, {"type": "direct"})  # values of block fields that ask for nothing (+ None, False)


def _refuse(param: str, message: str, code: str = "unsupported_field") -> GatewayError:
    return GatewayError(400, message, type="invalid_request_error", param=param, code=code)


def _unsupported(param: str, what: str) -> GatewayError:
    return _refuse(param, f"'{param}': {what} is not supported by this gateway's Messages API translation")


def _invalid(param: str, what: str) -> GatewayError:
    return _refuse(param, f"'{param}' {what}", "invalid_value")


def _only(block: dict[str, Any], param: str, *allowed: str) -> None:
    """Refuse any field of ``block`` beyond ``allowed`` (and the cache hint) that asks for something."""
    for key, value in block.items():
        if key not in allowed and key != "cache_control" and value is not None and value is not False \
                and value not in _HARMLESS:
            raise _unsupported(f"{param}.{key}", "this field")


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


# ---- request -----------------------------------------------------------------------------------------------

def _text(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else None
        raise _unsupported(param, f"a content block of type {kind!r} here")
    _only(block, param, "type", "text")
    if not isinstance(block.get("text"), str):
        raise _invalid(f"{param}.text", "must be a string")
    text: str = block["text"]
    return text


def _texts(content: Any, param: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(param, "must be a string or a list of text blocks")
    return "\n".join(_text(block, f"{param}[{j}]") for j, block in enumerate(content))


def _image(block: dict[str, Any], param: str) -> dict[str, Any]:
    _only(block, param, "type", "source")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        if not (isinstance(source.get("media_type"), str) and isinstance(source.get("data"), str)):
            raise _invalid(f"{param}.source", "needs a string media_type and data")
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source, dict) and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _unsupported(f"{param}.source", f"an image source of type {kind!r} (base64 and url are served)")
    return {"type": "image_url", "image_url": {"url": url}}


def _reference(block: Any, param: str) -> str | None:
    """The tool a ``tool_reference`` block (a tool search's result) loads, None for any other block."""
    if not isinstance(block, dict) or block.get("type") != "tool_reference":
        return None
    _only(block, param, "type", "tool_name", "cache_control")
    if not isinstance(block.get("tool_name"), str) or not block["tool_name"]:
        raise _invalid(f"{param}.tool_name", "must be a non-empty string")
    name: str = block["tool_name"]
    return name


def _tool_result(block: dict[str, Any], param: str) -> dict[str, Any]:
    _only(block, param, "type", "tool_use_id", "content", "is_error")
    if not isinstance(block.get("tool_use_id"), str):
        raise _invalid(f"{param}.tool_use_id", "must be a string")
    content = block.get("content")
    if isinstance(content, list):  # (a tool search's result: tool_reference blocks, each naming a tool it loads)
        lines = []
        for j, part in enumerate(content):
            name = _reference(part, f"{param}.content[{j}]")
            lines.append(f"Tool loaded: {name}" if name is not None else _text(part, f"{param}.content[{j}]"))
        text = "\n".join(lines)
    else:
        text = "" if content is None else _texts(content, f"{param}.content")
    if block.get("is_error"):
        text = "Error: " + text if text else "Error"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _user(content: Any, param: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list) or not content:
        raise _invalid(f"{param}.content", "must be a string or a non-empty list of content blocks")
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result" and isinstance(block, dict):
            if parts:  # chat tool messages must follow the assistant's calls directly; Anthropic refuses it too
                raise _invalid(where, "must come before any other content of the turn")
            messages.append(_tool_result(block, where))
        elif kind == "image" and isinstance(block, dict):
            parts.append(_image(block, where))
        else:
            parts.append({"type": "text", "text": _text(block, where)})
    if parts:
        texts = [part["text"] for part in parts if part["type"] == "text"]
        messages.append({"role": "user", "content": "\n".join(texts) if len(texts) == len(parts) else parts})
    return messages


def _arguments(tool_input: Any, param: str) -> str:
    if not isinstance(tool_input, dict):
        raise _invalid(param, "must be an object")
    if len(tool_input) == 1 and isinstance(tool_input.get("_raw"), str):  # what chat_to_message kept
        raw: str = tool_input["_raw"]
        return raw
    return orjson.dumps(tool_input).decode()


def _assistant(content: Any, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _invalid(f"{param}.content", "must be a string or a list of content blocks")
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and isinstance(block, dict):
            _only(block, where, "type", "id", "name", "input", "caller")
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)):
                raise _invalid(where, "needs a string id and name")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": _arguments(block.get("input"), f"{where}.input")}})
        elif kind == "thinking" and isinstance(block, dict):
            _only(block, where, "type", "thinking", "signature")
            if not isinstance(block.get("thinking"), str):
                raise _invalid(f"{where}.thinking", "must be a string")
            if block["thinking"]:
                reasoning.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # Claude's encrypted reasoning: no engine can read it (module docstring)
        else:
            texts.append(_text(block, where))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages", "must be a non-empty list of messages")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(param, "must be an object")
        _only(message, param, "role", "content")
        role = message.get("role")
        if role == "user":
            messages += _user(message.get("content"), param)
        elif role == "assistant":
            messages.append(_assistant(message.get("content"), param))
        elif role == "system":
            messages.append({"role": "system", "content": _texts(message.get("content"), f"{param}.content")})
        else:
            raise _invalid(f"{param}.role", f"{role!r} is not a message role")
    return messages


def _loaded(messages: Any) -> set[str]:
    """The tools that tool results in ``messages`` loaded (``tool_reference`` blocks)."""
    names: set[str] = set()
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            inner = block.get("content") if isinstance(block, dict) and block.get("type") == "tool_result" else None
            for part in inner if isinstance(inner, list) else ():
                if isinstance(part, dict) and part.get("type") == "tool_reference" and \
                        isinstance(part.get("tool_name"), str):
                    names.add(part["tool_name"])
    return names


def _tools(tools: Any, loaded: AbstractSet[str] = frozenset()) -> list[dict[str, Any]]:
    """The chat tools; a deferred tool (``defer_loading``) only once ``loaded`` names it."""
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list")
    out = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind not in (None, "custom"):
            raise _unsupported(param, f"the tool type {kind!r} (only custom tools with an input_schema are served)")
        # eager_input_streaming: arguments are always streamed as the engine produces them
        _only(tool, param, "type", "name", "description", "input_schema", "strict", "eager_input_streaming",
              "defer_loading")
        allowed = tool.get("allowed_callers")
        if allowed not in (None, ["direct"]):
            raise _unsupported(f"{param}.allowed_callers", "callers other than 'direct'")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _invalid(f"{param}.name", "must be a non-empty string")
        if not isinstance(tool.get("input_schema"), dict):
            raise _invalid(f"{param}.input_schema", "must be a JSON schema object")
        if tool.get("defer_loading") not in (None, True, False):
            raise _invalid(f"{param}.defer_loading", "must be a boolean")
        if tool.get("defer_loading") and tool["name"] not in loaded:
            continue
        function: dict[str, Any] = {"name": tool["name"], "parameters": tool["input_schema"]}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or kind not in ("auto", "any", "tool", "none"):
        raise _unsupported("tool_choice", f"tool_choice {choice!r}")
    _only(choice, "tool_choice", "type", "name", "disable_parallel_tool_use")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _invalid("tool_choice.name", "must be a string")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _thinking(thinking: Any, chat: dict[str, Any]) -> None:
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if not isinstance(thinking, dict) or kind not in ("enabled", "adaptive", "disabled"):
        raise _unsupported("thinking", f"thinking {thinking!r}")
    _only(thinking, "thinking", "type", "budget_tokens", "display")
    if kind == "enabled" and (not isinstance(thinking.get("budget_tokens"), int)
                              or isinstance(thinking["budget_tokens"], bool) or thinking["budget_tokens"] < 1024):
        raise _invalid("thinking.budget_tokens", "must be an integer of at least 1024 (as Anthropic and vLLM require)")
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise _invalid("thinking.display", "must be 'summarized' or 'omitted'")
    enabled = kind != "disabled"  # budget_tokens cannot be enforced by a chat request (module docstring)
    chat["chat_template_kwargs"] = {"enable_thinking": enabled, "thinking": enabled}


def _output_config(config: Any, chat: dict[str, Any]) -> None:
    if not isinstance(config, dict):
        raise _invalid("output_config", "must be an object")
    _only(config, "output_config", "effort", "format")
    effort = config.get("effort")
    if effort in ("low", "medium", "high"):
        chat["reasoning_effort"] = effort
    elif effort is not None:
        raise _unsupported("output_config.effort", f"effort {effort!r} (low, medium and high are served)")
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _invalid("output_config.format", "must be {'type': 'json_schema', 'schema': {...}}")
        _only(fmt, "output_config.format", "type", "schema")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def thinking_turns_kept(config: Any) -> int | None:
    """How many of the last assistant turns keep their reasoning under ``context_management`` (None: all)."""
    edits = config.get("edits") if isinstance(config, dict) else None
    if not isinstance(config, dict) or not isinstance(edits, list):
        raise _invalid("context_management", "must be an object with a list of edits")
    _only(config, "context_management", "edits")
    kept: int | None = None
    for i, edit in enumerate(edits):
        param = f"context_management.edits[{i}]"
        if not isinstance(edit, dict) or edit.get("type") != "clear_thinking_20251015":
            kind = edit.get("type") if isinstance(edit, dict) else None
            raise _unsupported(param, f"the edit {kind!r} (only clear_thinking_20251015 is served)")
        _only(edit, param, "type", "keep")
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})  # Anthropic's default: the last turn
        if keep in ("all", {"type": "all"}):
            continue
        value = keep.get("value") if isinstance(keep, dict) and keep.get("type") == "thinking_turns" else None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _invalid(f"{param}.keep", "must be 'all' or {'type': 'thinking_turns', 'value': <n >= 0>}")
        kept = value if kept is None else min(kept, value)
    return kept


def _clear_thinking(messages: list[dict[str, Any]], kept: int) -> None:
    with_reasoning = [m for m in messages if "reasoning_content" in m]
    for message in with_reasoning[:len(with_reasoning) - kept]:
        del message["reasoning_content"]


def _copy(to: str) -> Callable[[Any, dict[str, Any]], None]:
    def copy(value: Any, chat: dict[str, Any]) -> None:
        chat[to] = value
    return copy


def _stop_sequences(value: Any, chat: dict[str, Any]) -> None:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _invalid("stop_sequences", "must be a list of strings")
    if value:
        chat["stop"] = value


def _metadata(value: Any, chat: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        raise _invalid("metadata", "must be an object")
    _only(value, "metadata", "user_id")
    if isinstance(value.get("user_id"), str):
        chat["user"] = value["user_id"]


def _stream(value: Any, chat: dict[str, Any]) -> None:
    if value:  # the stream's message_delta reports usage, so the chat stream must carry it
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}


def _max_tokens(value: Any, chat: dict[str, Any]) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _invalid("max_tokens", "must be a positive integer (0, prompt-cache pre-warming, is not served)")
    chat["max_tokens"] = value


def _accepted(name: str, *values: Any) -> Callable[[Any, dict[str, Any]], None]:
    """A field accepted only at one of these values (which ask for nothing an engine does differently)."""
    def check(value: Any, chat: dict[str, Any]) -> None:
        if value not in values:
            raise _unsupported(name, f"{name}={value!r}")
    return check


def _ignored(value: Any, chat: dict[str, Any]) -> None:
    """A caching hint (module docstring)."""


# what each field becomes; model, messages, system and context_management are handled by _translate
_COMMON: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "tools": lambda v, chat: None,  # (by _translate: which deferred tools are loaded is in the messages)
    "tool_choice": _tool_choice, "thinking": _thinking, "output_config": _output_config,
    "cache_control": _ignored, "speed": _accepted("speed", "standard"),
}
_MESSAGES_FIELDS = {
    **_COMMON, "max_tokens": _max_tokens, "stop_sequences": _stop_sequences, "temperature": _copy("temperature"),
    "top_p": _copy("top_p"), "top_k": _copy("top_k"), "metadata": _metadata, "stream": _stream,
    "service_tier": _accepted("service_tier", "auto", "standard_only"),
}
_COUNT_FIELDS = _COMMON


def _translate(body: dict[str, Any], fields: dict[str, Callable[[Any, dict[str, Any]], None]]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _invalid("body", "must be a JSON object")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _texts(body["system"], "system")})
    messages += _messages(body.get("messages"))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name, value in body.items():
        if name in ("model", "messages", "system", "context_management") or value is None:
            continue
        if name not in fields:
            raise _unsupported(name, "this field" if name not in _MESSAGES_FIELDS else "this field in count_tokens")
        fields[name](value, chat)
    if body.get("tools"):
        tools = _tools(body["tools"], _loaded(body.get("messages")))
        if tools:
            chat["tools"] = tools
    if body.get("context_management") is not None:
        kept = thinking_turns_kept(body["context_management"])
        if kept is not None:
            _clear_thinking(messages, kept)
    if "tools" not in chat and chat.get("tool_choice") not in (None, "auto", "none"):
        raise _invalid("tool_choice", "names a tool use but there are no 'tools'")
    if "tools" not in chat:
        chat.pop("tool_choice", None)
        chat.pop("parallel_tool_calls", None)
    last = messages[-1]
    if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):  # a prefill
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    return chat


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request body -> a chat completions request body. Raises GatewayError(400,
    type="invalid_request_error", param=<the Anthropic field path>, code="unsupported_field" or "invalid_value")
    for anything that cannot be translated faithfully: nothing the client sent is silently dropped (the few
    deliberate exceptions are in the module docstring)."""
    if isinstance(body, dict) and body.get("max_tokens") is None:
        raise _invalid("max_tokens", "is required")
    return _translate(body, _MESSAGES_FIELDS)


def count_tokens_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/messages/count_tokens body -> the chat request whose prompt an engine would tokenize (messages,
    tools, template switches), validated as :func:`messages_to_chat` does. Generation settings (max_tokens,
    stream, sampling, stop_sequences, metadata) are not count_tokens fields and are refused, as Anthropic does."""
    return _translate(body, _COUNT_FIELDS)


# ---- answer ------------------------------------------------------------------------------------------------

def _usage(usage: Any) -> dict[str, Any]:
    """Chat usage -> Anthropic usage; input_tokens excludes the prompt tokens read from the cache."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    prompt = token_count(usage.get("prompt_tokens"))
    out: dict[str, Any] = {"input_tokens": prompt, "output_tokens": token_count(usage.get("completion_tokens"))}
    found = usage.get("prompt_tokens_details")
    if isinstance(found, dict) and "cached_tokens" in found:
        cached = details(usage, "prompt_tokens_details", "cached_tokens")
        out["input_tokens"] = max(prompt - cached, 0)
        out["cache_read_input_tokens"] = cached
    return out


def _stop(finish: Any, matched: Any, tool_calls: bool, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """The Anthropic stop_reason and stop_sequence for a chat finish_reason."""
    reason = _STOP_REASONS.get(finish)
    if reason is not None and reason != "tool_use":
        return reason, None
    if tool_calls or reason == "tool_use":
        return "tool_use", None
    if isinstance(matched, str) and (stop_sequences is None or matched in stop_sequences):
        return "stop_sequence", matched
    return "end_turn", None


def _matched_stop(choice: dict[str, Any]) -> Any:
    for field in _MATCHED_STOP:
        if isinstance(choice.get(field), str):
            return choice[field]
    return None


def _reasoning(part: dict[str, Any]) -> Any:
    # vLLM sends ``reasoning`` (in some versions the same text as ``reasoning_content`` too): one, not both
    return part.get("reasoning_content") or part.get("reasoning")


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def _tool_input(arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        parsed = None
    return parsed if isinstance(parsed, dict) else {"_raw": arguments}  # kept, not lost (module docstring)


def chat_to_message(chat: dict[str, Any], model: str, omit_thinking: bool = False) -> dict[str, Any]:
    """A non-streamed chat completion -> an Anthropic Message (validates as ``anthropic.types.Message``);
    ``omit_thinking`` (``thinking.display: "omitted"``): thinking blocks without their text."""
    choices = chat.get("choices")
    choice = _dict(choices[0]) if isinstance(choices, list) and choices else {}
    message = _dict(choice.get("message"))
    content: list[dict[str, Any]] = []
    reasoning = _reasoning(message)
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": "" if omit_thinking else reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or ():
        if isinstance(call, dict):
            function = _dict(call.get("function"))
            content.append({"type": "tool_use", "id": call.get("id") or new_tool_use_id(),
                            "name": function.get("name") or "", "input": _tool_input(function.get("arguments"))})
    stop_reason, stop_sequence = _stop(choice.get("finish_reason"), _matched_stop(choice),
                                       any(block["type"] == "tool_use" for block in content), None)
    return {"id": new_message_id(), "type": "message", "role": "assistant", "content": content, "model": model,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(chat.get("usage"))}


# ---- errors ------------------------------------------------------------------------------------------------

def _error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def _error_doc(type_: str, message: str) -> bytes:
    return orjson.dumps({"type": "error", "error": {"type": type_, "message": message}})


def anthropic_error(status: int, message: str) -> bytes:
    """The body Anthropic's API answers an error with: ``{"type": "error", "error": {"type", "message"}}``,
    the type by status (400 invalid_request_error ... 503/529 overloaded_error, 504 timeout_error)."""
    return _error_doc(_error_type(status), message)


def anthropic_error_from_openai(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body (``{"error": {"message", ...}}``) in :func:`anthropic_error`'s shape; a body
    of another shape gives its text as the message."""
    message: str | None = None
    try:
        doc: Any = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        if isinstance(inner, dict):
            doc = inner
        elif isinstance(inner, str):
            message = inner
        for key in ("message", "detail"):
            if message is None and isinstance(doc.get(key), str):
                message = doc[key]
    if message is None:
        text = body.decode("utf-8", "replace").strip()
        message = text if text else f"upstream answered HTTP {status} with an empty body"
    return anthropic_error(status, message)


# ---- stream ------------------------------------------------------------------------------------------------

def _event(out: list[bytes], kind: str, doc: dict[str, Any]) -> None:
    out.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n")


# A tool call's arguments that come before its name wait for it (a block announces its tool first): at most this
# many characters, then the stream fails (sweep 13: an engine's endless arguments without a name were kept
# whole, 5.5 GB RSS, and sent in one event at the end, holding the event loop 15 s)
MAX_EARLY_ARGUMENTS = 1 << 20
# Tool calls in one answer: each finished one's index is kept, to refuse a call reopened (sweep 15: an engine's
# endless calls, each with a 1 MB string for an index, grew the gateway ~100 MB/s for as long as it went on)
MAX_CALLS = 1024


class MessagesStream(Ending):
    """Chat completion stream -> Anthropic stream events, in Anthropic's order. One per streamed request.

    ``message_start`` (and a ``ping``) go out with the first chat chunk, not before, so that until then the
    gateway can still try another backend. One content block is open at a time: a delta of another kind
    (reasoning, text, another tool call) closes it and opens the next. Tool call arguments are passed through
    as ``partial_json`` fragments; only those that come before the call's name wait (in memory). ``usage`` is
    the chat usage seen in the stream (for accounting), None if none."""

    def __init__(self, model: str, stop_sequences: list[str] | None = None, omit_thinking: bool = False) -> None:
        self._model = model
        self._stop_sequences = stop_sequences
        self._omit_thinking = omit_thinking  # thinking.display "omitted": the block opens, no thinking_delta
        self._pending = b""
        self._started = False
        self._closed = False
        self._blocks = 0  # blocks started so far; the open one is the last
        self._open: str | None = None  # "text", "thinking" or "tool_use"
        self._call: Any = None  # the chat index of the open tool call
        self._call_started = False
        self._call_id = ""
        self._call_name = ""
        self._early_arguments: list[str] = []  # the open call's arguments that came before its name
        self._early_size = 0
        self._done_calls: set[Any] = set()
        self._tool_calls = False
        self._finish: Any = None
        self._matched: Any = None
        self.usage: dict[str, Any] | None = None

    def feed(self, sse: bytes) -> bytes:
        """Complete SSE events of a chat completions stream (several per call possible; comments and
        ``[DONE]`` are skipped; a trailing partial event waits for the next call) -> the Anthropic events to
        send, ``b""`` when none yet."""
        if self._closed:
            return b""
        events = (self._pending + sse.replace(b"\r\n", b"\n")).split(b"\n\n")
        self._pending = events.pop()
        out: list[bytes] = []
        for event in events:
            payload = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            if not payload or payload == b"[DONE]":
                continue
            try:
                doc = orjson.loads(payload)
            except orjson.JSONDecodeError:
                doc = None
            if not isinstance(doc, dict):
                self._fail(out, "the backend's stream carried an event that is not a JSON object")
            elif "choices" not in doc and ("error" in doc or doc.get("object") == "error"):
                err = _dict(doc["error"]) if isinstance(doc.get("error"), dict) else doc
                message = err.get("message")
                self._fail(out, message if isinstance(message, str) else str(doc.get("error")), err.get("code"),
                           err.get("type"))
            else:
                self._chunk(doc, out)
            if self._closed:
                break
        return b"".join(out)

    def _start(self, out: list[bytes]) -> None:
        if self._started:
            return
        self._started = True
        usage = {"input_tokens": _usage(self.usage)["input_tokens"] if self.usage else 0, "output_tokens": 0}
        message: dict[str, Any] = {"id": new_message_id(), "type": "message", "role": "assistant", "content": [],
                   "model": self._model, "stop_reason": None, "stop_sequence": None, "usage": usage}
        _event(out, "message_start", {"type": "message_start", "message": message})
        _event(out, "ping", {"type": "ping"})

    def _chunk(self, doc: dict[str, Any], out: list[bytes]) -> None:
        usage = doc.get("usage")
        if isinstance(usage, dict):  # consumed here, reported in message_delta
            self.usage = usage
        self._start(out)
        choices = doc.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is None:
            return
        delta = _dict(choice.get("delta"))
        reasoning = _reasoning(delta)
        if isinstance(reasoning, str) and reasoning:
            self._delta(out, "thinking", None if self._omit_thinking else
                        {"type": "thinking_delta", "thinking": reasoning})
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._delta(out, "text", {"type": "text_delta", "text": content})
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict) and not self._closed:
                self._tool_call(call, out)
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
            self._matched = _matched_stop(choice)

    def _delta(self, out: list[bytes], kind: str, delta: dict[str, Any] | None) -> None:
        if self._open != kind:
            self._stop_block(out)
            self._open = kind
            self._blocks += 1
            block = {"type": "text", "text": ""} if kind == "text" else {
                "type": "thinking", "thinking": "", "signature": ""}
            _event(out, "content_block_start",
                   {"type": "content_block_start", "index": self._blocks - 1, "content_block": block})
        if delta is not None:
            _event(out, "content_block_delta",
                   {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        index = call.get("index", 0)
        if type(index) is not int:  # (a list is no key at all; a 1 MB string one the gateway would keep)
            self._fail(out, "the backend's stream carried a tool call whose index is not an integer")
            return
        if self._open != "tool_use" or self._call != index:
            if index in self._done_calls:  # no engine does this; a block cannot be reopened once stopped
                self._fail(out, "the backend interleaved the fragments of several tool calls")
                return
            if len(self._done_calls) >= MAX_CALLS:
                self._fail(out, f"the backend's stream made more than {MAX_CALLS} tool calls")
                return
            self._stop_block(out)
            self._open, self._call, self._tool_calls = "tool_use", index, True
            self._call_started, self._call_id, self._call_name = False, "", ""
            self._blocks += 1
        function = _dict(call.get("function"))
        if isinstance(call.get("id"), str) and call["id"] and not self._call_id:
            self._call_id = call["id"]
        if isinstance(function.get("name"), str) and function["name"] and not self._call_started:
            self._call_name = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            if self._call_started:
                self._arguments_delta(out, arguments)
            else:
                self._early_arguments.append(arguments)
                self._early_size += len(arguments)
                if self._early_size > MAX_EARLY_ARGUMENTS:
                    self._fail(out, f"the backend's stream sent more than {MAX_EARLY_ARGUMENTS} characters of a tool "
                                    "call's arguments before its name")
                    return
        if not self._call_started and self._call_name:
            self._start_call(out)

    def _arguments_delta(self, out: list[bytes], arguments: str) -> None:
        _event(out, "content_block_delta", {"type": "content_block_delta", "index": self._blocks - 1,
                                            "delta": {"type": "input_json_delta", "partial_json": arguments}})

    def _start_call(self, out: list[bytes]) -> None:
        self._call_started = True
        block = {"type": "tool_use", "id": self._call_id or new_tool_use_id(), "name": self._call_name, "input": {}}
        _event(out, "content_block_start",
               {"type": "content_block_start", "index": self._blocks - 1, "content_block": block})
        if self._early_arguments:
            self._arguments_delta(out, "".join(self._early_arguments))
            self._early_arguments, self._early_size = [], 0

    def _stop_block(self, out: list[bytes]) -> None:
        if self._open is None:
            return
        if self._open == "tool_use":
            if not self._call_started:  # a call that never got its name
                self._start_call(out)
            self._done_calls.add(self._call)
        self._open = None
        _event(out, "content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})

    def _fail(self, out: list[bytes], message: str, code: Any = None, type_: Any = None) -> None:
        """An ``error`` event; the stream ends there (Anthropic sends no message_stop after an error)."""
        self._closed = True
        if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600:
            kind = _error_type(code)
        else:
            kind = next((k for k in (code, type_) if k in _ANTHROPIC_ERROR_TYPES), "api_error")
        out.append(b"event: error\ndata: " + _error_doc(kind, message) + b"\n\n")

    @property
    def closed(self) -> bool:
        """It sent its last event (completed, or failed): what the engine sends now is not translated."""
        return self._closed

    def close(self, error: str | None = None) -> bytes:
        """The closing events still owed: ``content_block_stop`` for an open block, ``message_delta`` (stop
        reason, usage) and ``message_stop``, or, with ``error``, an ``error`` event. Idempotent: b"" once
        closed."""
        out: list[bytes] = []
        if self._pending.strip() and not self._closed:  # a last event without its blank line
            out.append(self.feed(b"\n\n"))
        if self._closed:
            return b"".join(out)
        if error is not None:
            self._fail(out, error)
            return b"".join(out)
        # (what may fail on the engine's values first: abort() then still ends the stream)
        stop_reason, stop_sequence = _stop(self._finish, self._matched, self._tool_calls, self._stop_sequences)
        usage = _usage(self.usage)
        self._closed = True
        self._start(out)
        self._stop_block(out)
        if self.usage is None:
            del usage["input_tokens"]  # unknown: message_start's count stands
        _event(out, "message_delta", {"type": "message_delta", "usage": usage,
                                      "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}})
        _event(out, "message_stop", {"type": "message_stop"})
        return b"".join(out)
