"""OpenAI Responses API <-> chat completions: requests, answers and stream events (the conversations kept for
``previous_response_id`` are :mod:`gateway.api.response_store`'s).

``POST /v1/responses`` (``client.responses.create``, the Agents SDK, Codex) becomes a chat completions
request every engine serves; its answer and each of its stream events are turned back into a Response and
Responses stream events. Pure: no I/O, no framework.

What a request may say is decided field by field (``_FIELDS``); a field that cannot be honoured faithfully is
refused with a 400 naming it, never dropped. The decisions that are not obvious:

* ``reasoning`` input items (a previous answer's reasoning, sent back by a stateless client) become the
  ``reasoning_content`` of the assistant message they precede, which is how chat clients send reasoning back
  (llama.cpp, vLLM and SGLang read it). The chat template then does what it does for any chat client: most
  drop reasoning of earlier turns, interleaved-thinking templates keep it within a tool-calling turn. An item
  with only ``encrypted_content``/``summary`` (from OpenAI itself) is dropped: it is opaque or not the
  reasoning, and no engine could read it.
* ``include: ["reasoning.encrypted_content"]`` (Codex sends it with ``store: false``) is accepted: reasoning
  is returned in clear as ``reasoning_text`` content, which the client can send back as well as a blob.
  ``message.output_text.logprobs`` and ``top_logprobs`` map to the chat ``logprobs``/``top_logprobs``; the
  other includables concern built-in tools, which are refused, or input listing, which is not served.
* ``reasoning.summary: "auto"`` is accepted (no summariser exists, "auto" lets the server give what it has:
  the full reasoning text); ``"concise"``/``"detailed"`` are refused.
* ``instructions`` are not part of :func:`input_messages`: as on OpenAI, a response continuing this one
  (``previous_response_id``) does not inherit them.
* Bookkeeping (``BOOKKEEPING``: ``client_metadata``, ``metadata``, cache hints, ``max_tool_calls``) changes
  nothing generated: accepted whatever its value, never sent on (``metadata`` is echoed in the Response).
* A ``namespace`` of function tools is flattened under qualified names and its calls mapped back
  (:mod:`gateway.api.translate.responses_tools`); a built-in tool is refused.
* Function tools keep their ``strict`` as given; when absent (OpenAI's default there is ``true``) the engine's
  chat default applies.
* The common sampling extensions (``_PASSTHROUGH``: ``top_k``, ``seed``, ``stop`` ...), sent by clients through
  ``extra_body``, pass through to the chat request unchanged.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import orjson

from gateway.api.translate.ending import Ending
from gateway.api.translate.figures import details, token_count
from gateway.api.translate.responses_tools import call_name, chat_tools, echoed, namespaced, qualified
from gateway.errors import GatewayError

_PASSTHROUGH = ("top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INCLUDABLE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.output_text.logprobs",
})
# ResponseError.code is a closed set in the SDK; an engine's own code is kept only when it is one of them
_ERROR_CODES = frozenset({"server_error", "rate_limit_exceeded", "invalid_prompt"})
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(24)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _refuse(param: str, message: str, code: str = "unsupported_field") -> GatewayError:
    return GatewayError(400, message, type="invalid_request_error", param=param, code=code)


def _unsupported(param: str, what: str) -> GatewayError:
    return _refuse(param, f"'{param}': {what} is not supported by this gateway's Responses API translation")


# ---- request -----------------------------------------------------------------------------------------------

def _text_parts(parts: list[Any], param: str, allow: tuple[str, ...]) -> list[str]:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allow:
            raise _unsupported(param, f"a content part of type {kind!r} here")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise _refuse(param, f"'{param}': a {kind} part needs a string", "invalid_value")
        texts.append(text)
    return texts


def _content(content: Any, role: str, param: str) -> Any:
    """A message's content in chat form: a string, or (several parts, or an image) a list of chat parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(param, f"'{param}': content must be a string or a list of parts", "invalid_value")
    if role == "assistant":
        texts = _text_parts(content, param, ("output_text", "input_text", "refusal"))
        return texts[0] if len(texts) == 1 else "".join(texts)
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and role == "user":
            if part.get("file_id") is not None or not isinstance(part.get("image_url"), str):
                raise _unsupported(param, "an input_image by file_id (files are not stored here)")
            image: dict[str, Any] = {"url": part["image_url"]}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            parts.append({"type": "text", "text": _text_parts([part], param, ("input_text",))[0]})
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def _tool_output(output: Any, param: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return "".join(_text_parts(output, param, ("input_text", "output_text")))
    raise _refuse(param, f"'{param}': output must be a string or a list of text parts", "invalid_value")


def input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages (what :func:`responses_to_chat` puts after the history and
    the store keeps). ``instructions`` are not among them: a later response does not inherit them."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise _refuse("input", "'input' must be a string or a list of items", "invalid_value")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # waits for the assistant message it belongs to

    def assistant(text: bool) -> dict[str, Any]:
        """The assistant message to extend: the last one, when nothing came after it (and, for text, it has
        no tool calls yet: chat puts text before them), else a new one."""
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or reasoning is not None or (text and "tool_calls" in last):
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning is not None:
            last["reasoning_content"] = reasoning
            reasoning = None
        return last

    for i, item in enumerate(raw):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _refuse(param, f"'{param}' must be an object", "invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _refuse(f"{param}.role", f"'{param}.role' {role!r} is not a message role", "invalid_value")
            content = _content(item.get("content"), role, f"{param}.content")
            if role == "assistant":
                message = assistant(text=True)
                message["content"] = content if message["content"] is None else message["content"] + content
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
                raise _refuse(param, f"'{param}': a function_call needs string call_id, name and arguments",
                              "invalid_value")
            if isinstance(item.get("namespace"), str):  # (a call of a namespace's tool: the name it was offered as)
                name = qualified(item["namespace"], name)
            message = assistant(text=False)
            message.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _refuse(f"{param}.call_id", f"'{param}.call_id' must be a string", "invalid_value")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _tool_output(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            texts = [part.get("text") for part in item.get("content") or () if isinstance(part, dict)]
            text = "".join(t for t in texts if isinstance(t, str))
            # an encrypted or summary-only item is opaque to every engine (module docstring); reasoning that no
            # assistant output follows has no chat form (templates render it only as part of an assistant turn)
            if text:
                reasoning = text if reasoning is None else reasoning + text
        else:
            raise _unsupported(param, f"an input item of type {kind!r}")
    return messages


def _tools(tools: Any, chat: dict[str, Any]) -> None:
    offered = chat_tools(tools) if tools else []
    if offered:  # (none when every tool is one left out, web_search: responses_tools)
        chat["tools"] = offered


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _unsupported("tool_choice", f"tool_choice {choice!r}")


def _text(text: Any, chat: dict[str, Any]) -> None:
    if not isinstance(text, dict):
        raise _refuse("text", "'text' must be an object", "invalid_value")
    if text.get("verbosity") is not None:
        raise _unsupported("text.verbosity", "verbosity (engines have no such control)")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if fmt is None or kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise _refuse("text.format", "'text.format' json_schema needs a name and a schema", "invalid_value")
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    else:
        raise _unsupported("text.format", f"the format {kind!r}")


def _reasoning(reasoning: Any, chat: dict[str, Any]) -> None:
    if not isinstance(reasoning, dict):
        raise _refuse("reasoning", "'reasoning' must be an object", "invalid_value")
    for key, value in reasoning.items():
        if key == "effort":
            if value is not None:
                chat["reasoning_effort"] = value
        elif key in ("summary", "generate_summary"):
            if value not in (None, "auto"):
                raise _unsupported(f"reasoning.{key}", f"a {value!r} summary (the reasoning text is returned)")
        elif value is not None and not (key == "mode" and value == "standard"):
            raise _unsupported(f"reasoning.{key}", "this reasoning option")


def _include(include: Any, chat: dict[str, Any]) -> None:
    if not isinstance(include, list) or not all(isinstance(v, str) and v in _INCLUDABLE for v in include):
        raise _refuse("include", f"'include' must list some of {sorted(_INCLUDABLE)}", "invalid_value")
    if "message.output_text.logprobs" in include:
        chat["logprobs"] = True


def _top_logprobs(value: Any, chat: dict[str, Any]) -> None:
    chat["logprobs"] = True
    chat["top_logprobs"] = value


def _absent_or(*allowed: Any) -> Callable[[str, Any], None]:
    """A field accepted only at one of these values (it then asks for nothing the gateway does not do)."""
    def check(name: str, value: Any) -> None:
        if value is not None and value not in allowed:
            shown = " or ".join(repr(a) for a in allowed)
            raise _refuse(name, f"'{name}': {name}={value!r} is not supported by this gateway's Responses API "
                                f"translation; leave it out{f' or send {shown}' if allowed else ''}")
    return check


def _copy(to: str) -> Callable[[Any, dict[str, Any]], None]:
    def copy(value: Any, chat: dict[str, Any]) -> None:
        chat[to] = value
    return copy


# what each field becomes: a mapping into the chat body, a check (accepted values map to nothing), or None:
# handled elsewhere, echoed in the Response, or the gateway's business (store, previous_response_id)
_MAPPED: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    "max_output_tokens": _copy("max_tokens"), "temperature": _copy("temperature"), "top_p": _copy("top_p"),
    "parallel_tool_calls": _copy("parallel_tool_calls"), "user": _copy("user"),
    "tools": lambda v, chat: _tools(v, chat),
    "tool_choice": lambda v, chat: chat.__setitem__("tool_choice", _tool_choice(v)),
    "text": _text, "reasoning": _reasoning, "include": _include, "top_logprobs": _top_logprobs,
    **{name: _copy(name) for name in _PASSTHROUGH},
}
_CHECKED: dict[str, Callable[[str, Any], None]] = {
    "truncation": _absent_or("disabled"), "background": _absent_or(False),
    "service_tier": _absent_or("auto", "default"),
    "stream_options": _absent_or({}, {"include_obfuscation": False}),
    **{name: _absent_or() for name in ("conversation", "prompt", "context_management", "moderation",
                                       "access_programs", "image", "prompt_cache_options", "background_options")},
}
_HANDLED = frozenset({"model", "input", "instructions", "stream", "store", "previous_response_id",
                      "safety_identifier"})
# Bookkeeping: fields that change nothing an engine generates, accepted whatever their value and not sent to
# it (a tolerant reader: a client adding ids or hints must not be locked out). Each is listed with why it
# changes nothing; a field not listed anywhere is refused, naming it.
BOOKKEEPING: dict[str, str] = {
    "client_metadata": "the client's own ids (Codex: its session and turn ids), for its logs",
    "metadata": "labels for the client, echoed in the Response as OpenAI does",
    "prompt_cache_key": "a cache hint; the gateway's prefix-aware routing already keeps a prefix where cached",
    "prompt_cache_retention": "how long OpenAI keeps a cached prefix; engines keep theirs as they do",
    "max_tool_calls": "a bound on built-in tool calls, of which there are none here",
}


def responses_to_chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Responses request body -> a chat completions request body. ``history``: the chat messages of the
    conversation so far (from :class:`ResponseStore`, when the request names ``previous_response_id``), put
    after this request's ``instructions`` and before its input. Raises GatewayError(400, param=<field>,
    code="unsupported_field" or "invalid_value") for what cannot be translated faithfully."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _unsupported("instructions", "instructions other than a string")
        messages.append({"role": "system", "content": instructions})
    messages += history or ()
    messages += input_messages(body)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name, value in body.items():
        if name in _MAPPED:
            if value is not None:
                _MAPPED[name](value, chat)
        elif name in _CHECKED:
            _CHECKED[name](name, value)
        elif name not in _HANDLED and name not in BOOKKEEPING:
            raise _refuse(name, f"'{name}' is not supported by this gateway's Responses API translation (it cannot "
                                "be honoured faithfully); leave it out of the request")
    if "user" not in chat and isinstance(body.get("safety_identifier"), str):
        chat["user"] = body["safety_identifier"]
    if "tools" not in chat and chat.pop("tool_choice", "auto") not in ("auto", "none"):
        raise _refuse("tool_choice", "'tool_choice' names a tool but there are no 'tools'", "invalid_value")
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


# ---- answer ------------------------------------------------------------------------------------------------

def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt = token_count(usage.get("prompt_tokens"))
    completion = token_count(usage.get("completion_tokens"))
    cached = details(usage, "prompt_tokens_details", "cached_tokens")
    reasoning = details(usage, "completion_tokens_details", "reasoning_tokens")
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": token_count(usage.get("total_tokens")) or prompt + completion}


def _skeleton(request: dict[str, Any], response_id: str, created_at: int, model: Any) -> dict[str, Any]:
    """The Response with the request's settings echoed, as OpenAI does; status in progress, no output yet."""
    text = _obj(request.get("text"))
    reasoning = _obj(request.get("reasoning"))
    tools = echoed(request)
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": "in_progress",
        "background": False, "error": None, "incomplete_details": None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"), "model": model or request.get("model") or "",
        "output": [], "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": request.get("previous_response_id"),
        "prompt_cache_key": request.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": request.get("safety_identifier"), "service_tier": "default",
        "store": request.get("store", True) is not False, "temperature": request.get("temperature"),
        "text": {"format": text.get("format") or {"type": "text"}, "verbosity": text.get("verbosity")},
        "tool_choice": request.get("tool_choice") or "auto", "tools": tools,
        "top_logprobs": request.get("top_logprobs"), "top_p": request.get("top_p"), "truncation": "disabled",
        "usage": None, "user": request.get("user"), "metadata": request.get("metadata") or {},
    }


def _finish(response: dict[str, Any], finish_reason: Any, usage: Any) -> None:
    reason = _INCOMPLETE.get(finish_reason)
    response["status"] = "incomplete" if reason else "completed"
    response["incomplete_details"] = {"reason": reason} if reason else None
    response["completed_at"] = int(time.time()) if not reason else None
    response["usage"] = _usage(usage)


def _logprobs(content: Any) -> list[dict[str, Any]]:
    """Chat ``logprobs.content`` -> output_text logprobs (the same shape, ``bytes`` required)."""
    out = []
    for entry in content or ():
        if isinstance(entry, dict):
            top = [{"token": t.get("token", ""), "bytes": t.get("bytes") or [], "logprob": t.get("logprob", 0.0)}
                   for t in entry.get("top_logprobs") or () if isinstance(t, dict)]
            out.append({"token": entry.get("token", ""), "bytes": entry.get("bytes") or [],
                        "logprob": entry.get("logprob", 0.0), "top_logprobs": top})
    return out


def _message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(item_id: str, call_id: str, name: dict[str, str], arguments: str, status: str) -> dict[str, Any]:
    """``name``: the call's ``name`` (and ``namespace``, for a namespace's tool: :func:`call_name`)."""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, **name,
            "arguments": arguments}


def chat_to_response(chat: dict[str, Any], request: dict[str, Any], response_id: str) -> dict[str, Any]:
    """A non-streamed chat completion -> a Response object (validates as ``openai.types.responses.Response``)."""
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = _obj(choice.get("message"))
    finish = choice.get("finish_reason")
    created = chat.get("created")
    response = _skeleton(request, response_id, created if isinstance(created, int) else int(time.time()),
                         request.get("model") or chat.get("model"))
    output = response["output"]
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(_reasoning_item(_item_id("rs"), reasoning, "completed"))
    content = message.get("content")
    calls = [c for c in message.get("tool_calls") or () if isinstance(c, dict)]
    if (isinstance(content, str) and content) or not (output or calls):
        logprobs = _obj(choice.get("logprobs")).get("content")
        output.append(_message_item(_item_id("msg"), content if isinstance(content, str) else "", "completed",
                                    _logprobs(logprobs) if logprobs is not None else None))
    names = namespaced(request)
    for call in calls:
        function = _obj(call.get("function"))
        output.append(_call_item(_item_id("fc"), call.get("id") or _item_id("call"),
                                 call_name(names, function.get("name") or ""), function.get("arguments") or "",
                                 "completed"))
    if finish in _INCOMPLETE:  # the last item is the one cut short
        output[-1]["status"] = "incomplete"
    _finish(response, finish, chat.get("usage"))
    return response


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A Response's output as chat messages (one assistant message: content, reasoning_content, tool_calls),
    for the store; works on responses this module built and on those a native engine returned. Output items
    of built-in tools (which a native engine may return) have no chat form and are left out."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in response.get("output") or ():
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "message":
            texts += [p.get("text") or p.get("refusal") or "" for p in item.get("content") or ()
                      if isinstance(p, dict)]
        elif kind == "reasoning":
            reasoning += [p.get("text") or "" for p in item.get("content") or () if isinstance(p, dict)]
        elif kind == "function_call":
            name = item.get("name")
            if isinstance(item.get("namespace"), str) and isinstance(name, str):
                name = qualified(item["namespace"], name)
            calls.append({"id": item.get("call_id"), "type": "function",
                          "function": {"name": name, "arguments": item.get("arguments")}})
    if texts:
        message["content"] = "".join(texts)
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return [message] if texts or reasoning or calls else []


# ---- stream ------------------------------------------------------------------------------------------------

class _Item:
    """An output item being streamed: its text (or arguments) kept for the .done events and the Response."""

    __slots__ = ("call_id", "id", "index", "kind", "logprobs", "name", "names", "opened", "parts")

    def __init__(self, kind: str, index: int, logprobs: bool, names: dict[str, tuple[str, str]]) -> None:
        self.kind = kind  # "reasoning", "message" or "function_call"
        self.index = index
        self.id = _item_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.parts: list[str] = []
        self.logprobs: list[dict[str, Any]] | None = [] if logprobs else None
        self.call_id = ""
        self.name = ""
        self.names = names  # the request's namespaced tools (qualified name -> namespace, name)
        self.opened = False  # a function call opens once its name is known

    def item(self, status: str) -> dict[str, Any]:
        text = "".join(self.parts)
        if self.kind == "reasoning":
            return _reasoning_item(self.id, text, status)
        if self.kind == "message":
            return _message_item(self.id, text, status, self.logprobs)
        return _call_item(self.id, self.call_id, call_name(self.names, self.name), text, status)


# What a stream keeps for its closing events (each item's whole text in its .done events, all of them again in
# response.completed): past it the stream fails. A hostile engine's endless stream of ordinary chunks was kept
# whole and written out four times at its end: 100 MB held the event loop 1.1 s, 400 MB 13.6 s, sweep 13.
# Characters of text, reasoning, arguments, tool names and call ids (logprobs KEPT_PER_LOGPROB each, an output
# item KEPT_PER_ITEM; sweep 15: 1,000 names of 1 MB made a 1 GB closing event, the loop held 9.5 s): 1M
# is ~250k tokens, more than limits.max_tokens lets any answer have, and closing one costs ~10 ms (4M held the
# loop ~80 ms each, 3.9 s with 48 such streams at once; sweep 14). Items are at most MAX_ITEMS (a hostile
# engine's 3M nameless-argument tool calls grew the gateway 75 MB/s and held the loop 4 s at the close).
MAX_KEPT_CHARS = 1 << 20
KEPT_PER_LOGPROB = 64
KEPT_PER_ITEM = 256
MAX_ITEMS = 1024


class ResponsesStream(Ending):
    """Chat completion stream -> Responses stream events, in OpenAI's order. One per streamed request.

    ``response.created``/``response.in_progress`` go out with the first chat chunk, not before, so that until
    then the gateway can still try another backend. One output item is open at a time: a chunk of another
    kind (reasoning, text, another tool call) finishes it. ``response`` is the final Response once closed
    (for the store); ``usage`` the chat usage seen in the stream."""

    def __init__(self, request: dict[str, Any], response_id: str) -> None:
        self._response = _skeleton(request, response_id, int(time.time()), request.get("model"))
        self._names = namespaced(request)
        self._logprobs = bool(request.get("top_logprobs")) or "message.output_text.logprobs" in (
            request.get("include") or ())
        self._seq = 0
        self._pending = b""
        self._started = False
        self._closed = False
        self._finish: Any = None
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._calls: dict[Any, _Item] = {}  # chat tool call index -> its item
        self._kept = 0  # what the items hold, in characters (see MAX_KEPT_CHARS)
        self.response: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None

    def feed(self, sse: bytes) -> bytes:
        """Complete SSE events of a chat completions stream (several per call possible; a trailing partial
        event waits for the next call) -> the Responses events to send, ``b""`` when none yet."""
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
            elif "error" in doc and "choices" not in doc:
                err = doc["error"]
                if isinstance(err, dict):
                    self._fail(out, str(err.get("message")), err.get("code"))
                else:
                    self._fail(out, str(err))
            else:
                self._chunk(doc, out)
            if self._closed:
                break
        return b"".join(out)

    def _event(self, out: list[bytes], kind: str, **fields: Any) -> None:
        fields["type"] = kind
        fields["sequence_number"] = self._seq
        self._seq += 1
        out.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(fields) + b"\n\n")

    def _start(self, out: list[bytes]) -> None:
        if not self._started:
            self._started = True
            self._event(out, "response.created", response=self._response)
            self._event(out, "response.in_progress", response=self._response)

    def _chunk(self, doc: dict[str, Any], out: list[bytes]) -> None:
        self._start(out)
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = doc.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is None:
            return
        delta = _obj(choice.get("delta"))
        # vLLM sends ``reasoning`` (and, in some versions, the same text as ``reasoning_content`` too)
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            item = self._item("reasoning", out)
            item.parts.append(reasoning)
            self._kept += len(reasoning)
            self._event(out, "response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                        content_index=0, delta=reasoning)
        content = delta.get("content")
        if isinstance(content, str) and content:
            item = self._item("message", out)
            item.parts.append(content)
            self._kept += len(content)
            logprobs = choice.get("logprobs")
            # (only where the client asked: an engine's unasked logprobs were translated on every chunk)
            entries = _logprobs(logprobs.get("content")) if self._logprobs and isinstance(logprobs, dict) else []
            if item.logprobs is not None:
                item.logprobs += entries
                self._kept += KEPT_PER_LOGPROB * sum(1 + len(e["top_logprobs"]) for e in entries)
            self._event(out, "response.output_text.delta", item_id=item.id, output_index=item.index,
                        content_index=0, delta=content, logprobs=[_delta_logprob(e) for e in entries])
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict) and not self._closed:
                self._tool_call(call, out)
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
        if (self._kept > MAX_KEPT_CHARS or len(self._items) > MAX_ITEMS) and not self._closed:
            self._fail(out, f"the answer is longer than the gateway translates to the Responses API ({MAX_KEPT_CHARS} "
                            f"characters of text, reasoning and arguments, {MAX_ITEMS} output items): ask for less, "
                            "or use chat completions")

    def _item(self, kind: str, out: list[bytes]) -> _Item:
        """The open item if it is a text or reasoning item of this kind, else a new one (the open one is
        finished first). A function call's item is announced once its name is known."""
        if self._open is not None and self._open.kind == kind != "function_call":
            return self._open
        self._done(out)
        item = _Item(kind, len(self._items), self._logprobs, self._names)
        self._items.append(item)
        self._kept += KEPT_PER_ITEM
        self._open = item
        if kind != "function_call":
            self._added(item, out)
        return item

    def _added(self, item: _Item, out: list[bytes]) -> None:
        item.opened = True
        added = item.item("in_progress")
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            added["arguments"] = ""
            self._event(out, "response.output_item.added", output_index=item.index, item=added)
            if item.parts:  # arguments that came before the name
                self._event(out, "response.function_call_arguments.delta", **where, delta="".join(item.parts))
            return
        part = added["content"].pop()  # the part is announced by its own event
        self._event(out, "response.output_item.added", output_index=item.index, item=added)
        self._event(out, "response.content_part.added", **where, content_index=0, part=part)

    def _tool_call(self, call: dict[str, Any], out: list[bytes]) -> None:
        index = call.get("index", 0)
        if type(index) is not int:  # (a list is no key at all; a 1 MB string one the gateway would keep)
            self._fail(out, "the backend's stream carried a tool call whose index is not an integer")
            return
        item = self._calls.get(index)
        if item is None:
            item = self._calls[index] = self._item("function_call", out)
        elif item is not self._open:  # no engine does this; an item cannot be reopened once done
            self._fail(out, "the backend interleaved the fragments of several tool calls")
            return
        function = _obj(call.get("function"))
        if isinstance(call.get("id"), str) and call["id"] and not item.call_id:
            item.call_id = call["id"]
            self._kept += len(item.call_id)
        if isinstance(function.get("name"), str) and not item.opened:
            self._kept += len(function["name"]) - len(item.name or "")
            item.name = function["name"]
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            item.parts.append(arguments)
            self._kept += len(arguments)
            if item.opened:
                self._event(out, "response.function_call_arguments.delta", item_id=item.id,
                            output_index=item.index, delta=arguments)
        if not item.opened and item.name:
            item.call_id = item.call_id or _item_id("call")
            self._added(item, out)

    def _done(self, out: list[bytes]) -> None:
        """Finish the open item: its .done events; it joins the Response's output."""
        item, self._open = self._open, None
        if item is None:
            return
        if not item.opened:
            item.call_id = item.call_id or _item_id("call")
            self._added(item, out)
        final = item.item("incomplete" if self._finish in _INCOMPLETE else "completed")
        text = "".join(item.parts)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            self._event(out, "response.reasoning_text.done", **where, content_index=0, text=text)
            self._event(out, "response.content_part.done", **where, content_index=0, part=final["content"][0])
        elif item.kind == "message":
            self._event(out, "response.output_text.done", **where, content_index=0, text=text,
                        logprobs=[_delta_logprob(e) for e in item.logprobs or ()])
            self._event(out, "response.content_part.done", **where, content_index=0, part=final["content"][0])
        else:
            self._event(out, "response.function_call_arguments.done", **where, arguments=text)
        self._event(out, "response.output_item.done", output_index=item.index, item=final)
        self._response["output"].append(final)

    def _fail(self, out: list[bytes], message: str, code: Any = None) -> None:
        self._start(out)
        self._closed = True
        response = self._response
        response["status"] = "failed"
        response["error"] = {"code": code if code in _ERROR_CODES else "server_error", "message": message}
        response["usage"] = _usage(self.usage)
        self.response = response
        self._event(out, "response.failed", response=response)

    @property
    def closed(self) -> bool:
        """It sent its last event (completed, or failed): what the engine sends now is not translated."""
        return self._closed

    def close(self, error: str | None = None) -> bytes:
        """The closing events still owed: the .done events of the open item, then ``response.completed`` (or
        ``response.incomplete`` when the answer was cut short), or, with ``error``, ``response.failed``.
        Idempotent: b"" once closed."""
        out: list[bytes] = []
        if self._pending.strip() and not self._closed:  # a last event without its blank line
            out.append(self.feed(b"\n\n"))
        if self._closed:
            return b"".join(out)
        if error is not None:
            self._fail(out, error)
            return b"".join(out)
        self._start(out)
        if self._open is None and not self._items:  # nothing was generated: an empty message, as OpenAI does
            self._item("message", out)
        self._done(out)
        response = self._response
        _finish(response, self._finish, self.usage)
        self._closed = True  # (after what may fail on the engine's values: abort() then still ends it)
        self.response = response
        self._event(out, f"response.{response['status']}", response=response)
        return b"".join(out)


def _delta_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """An output_text logprob in the shape of the delta/done events (no ``bytes``)."""
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]}
