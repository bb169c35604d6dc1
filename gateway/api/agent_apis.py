"""The agent APIs (OpenAI Responses, Anthropic Messages) served over the chat completions path.

A request on one of these routes is translated to a chat completions request (``gateway.api.translate``) and
then goes through exactly what a chat request goes through: validation, structured-output translation,
routing (on the chat rendering, so the same conversation shares its prefix whichever API carried it),
failover, the stream relay and its measurements (time to first token counts the first generated token of
any kind, before translation). Only the answer is translated back, by wrapping the ASGI ``send`` the
endpoint answers through: status, error bodies (in Anthropic's own shape on ``/v1/messages``), the JSON
answer, and every stream event.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson

from gateway.api.native_apis import COUNT_TOKENS, MESSAGES, RESPONSES, TOKENIZED_COUNT, StreamTap, chat_usage
from gateway.api.response_store import ResponseStore, decode_conversation
from gateway.api.translate.count_tokens import countable, encode_request
from gateway.api.translate.messages import (
    MessagesStream,
    anthropic_error_from_openai,
    chat_to_message,
    count_tokens_chat,
    messages_to_chat,
    thinking_turns_kept,
)
from gateway.api.translate.responses import (
    ResponsesStream,
    chat_to_response,
    input_messages,
    new_response_id,
    output_messages,
    responses_to_chat,
)
from gateway.api.translate.responses_tools import is_omitted, omitted
from gateway.api.validation import check_depth
from gateway.asgi import Message, Send
from gateway.config import LimitSettings
from gateway.engines.spec import EngineSpec
from gateway.errors import GatewayError
from gateway.pool.backend import Backend
from gateway.proxy.cache_isolation import isolate
from gateway.proxy.exchange import Exchange
from gateway.proxy.forward import NativeApi, parse_units
from gateway.routing.request import RouteRequest

_JSON = b"application/json"
# translating an answer costs ~7x parsing it (gateway.proxy.forward.parse_units' units): bounded to ~0.25 s
MAX_ANSWER_UNITS = 700_000
BIG_EVENT_BYTES = 16 * 1024  # stream events (and answers) larger than this have their translation cost counted
MAX_EVENT_UNITS = 20_000  # one stream event: ~7 ms to translate
MAX_STREAM_UNITS = 1_000_000  # a stream's large events in all
log = logging.getLogger("gateway.proxy")


# what reading a JSON value of another type than chat completions put there raises (the translations read the
# engine's answers, streams and errors as chat completions should be; an engine may answer anything)
_SHAPE_ERRORS = (TypeError, AttributeError, KeyError, ValueError, IndexError)


def _untranslatable(exc: BaseException) -> GatewayError:
    """The engine's answer could not be read as chat completions (a finish reason that is a list, usage details
    that are a number): its fault, a 502, not the gateway's 500 (sweep 16)."""
    log.warning("a backend's answer could not be translated: %s: %s", type(exc).__name__, str(exc)[:200])
    return GatewayError(502, f"the backend's answer is not a chat completion this API can be translated from "
                             f"({type(exc).__name__})", code="upstream_failed")


def _closed_on(stream: Any, exc: BaseException) -> bytes:
    """A translated stream the engine's events could not be read into: ended with its API's failure event (when
    even that cannot be written from what it holds, the response simply ends)."""
    error = _untranslatable(exc)
    try:
        return bytes(stream.abort(str(error.message)))
    except _SHAPE_ERRORS:
        return b""


def _translated(translate: Callable[[dict[str, Any]], dict[str, Any]], body: dict[str, Any]) -> dict[str, Any]:
    """``translate(body)``, where a body of the right shape at the top but not further down (a number where a
    list of content parts goes, a list where a string goes) is the client's 400, not a 500: the translations
    read deep structures the validation after them sees only as translated."""
    try:
        return translate(body)
    except GatewayError:
        raise
    except _SHAPE_ERRORS as exc:
        log.debug("translation failed", exc_info=True)
        raise GatewayError(400, f"The request body cannot be read as this API's request ({type(exc).__name__}: "
                                f"{str(exc)[:200]})", code="invalid_request") from None


def _bounded(body: dict[str, Any], field: str, limits: LimitSettings) -> None:
    """A 400 for a list of more items than ``limits.max_messages``, or of more tools than ``limits.max_tools``
    (those left out included), counted before any is translated (an 8 MiB body of 280,000 tiny items held the
    event loop for half a second in translation; 40,000 tools left out, 8 s)."""
    items = body.get(field)
    if isinstance(items, list) and len(items) > limits.max_messages:
        raise GatewayError(400, f"'{field}' has {len(items)} entries; this gateway accepts at most "
                                f"{limits.max_messages}", param=field, code="invalid_request")
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > limits.max_tools:
        raise GatewayError(400, f"'tools' has {len(tools)} entries; this gateway accepts at most {limits.max_tools}",
                           param="tools", code="invalid_request")


class Translation:
    """One request's translation: the chat body it became, and the answer's way back; or, per attempt, the
    client's own request passed through to an engine that serves the API (:meth:`native`)."""

    api = ""  # "messages" | "responses"
    items = ""  # the field holding the conversation's items (bounded by limits.max_messages)
    history_size = 0  # bytes of the stored conversation the request continues (Responses), once loaded
    native_api: NativeApi
    exchange: Exchange | None = None
    route_request: RouteRequest | None = None
    passthrough = False  # this attempt sends the client's own request (set by ``native``)
    notes: tuple[tuple[bytes, bytes], ...] = ()  # response headers saying what the translation left out
    _tap: StreamTap | None = None

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def load(self, body: dict[str, Any], limits: LimitSettings, room: int) -> dict[str, Any]:
        """The client's request (decoded, its key's checks passed) as a chat completions request, with whatever
        it needs fetched first (a stored conversation, of at most ``room`` bytes). A 400 for a body past the
        limits, checked first, or one the translation cannot read."""
        check_depth(body, limits, constraints=False)
        _bounded(body, self.items, limits)
        return _translated(self.to_chat, body)

    def servable(self, spec: EngineSpec) -> bool:
        """Whether an engine can serve this request at all (routing keeps only those that can)."""
        return True

    def native_body(self) -> dict[str, Any] | None:
        """The request to pass through, or None when this one must be translated."""
        raise NotImplementedError

    def native(self, backend: Backend) -> tuple[bytes, NativeApi] | None:
        """Per attempt: the client's request and its API, when ``backend`` serves the API itself and nothing in
        the request needs the gateway (a structured-output or forced-tool constraint is enforced and checked
        on the chat path); else None, and the attempt sends the chat translation."""
        self.passthrough = False
        request = self.route_request
        if self.api not in backend.spec.native_apis or request is None or request.constraint is not None:
            return None
        body = self.native_body()
        if body is None:
            return None
        body = {**body, "model": request.model}  # (an alias's target, or a fallback)
        if not isolate(body, request, backend.spec, self.api):  # (kept to its cache domain, else translated)
            return None
        self.passthrough = True
        return orjson.dumps(body), self.native_api

    def passed(self, usage: Any, response: dict[str, Any] | None) -> None:
        """A passed-through answer's usage (the API's own names) and, on Responses, the whole response."""
        if self.exchange is not None:
            self.exchange.usage = chat_usage(self.api, usage)

    def error(self, status: int, body: bytes) -> bytes:
        """An error body (OpenAI's shape) in this API's shape."""
        return body

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed chat completion in this API's shape."""
        raise NotImplementedError

    def stream(self) -> Any:
        """A stream translator: ``feed(sse) -> bytes``, ``close(error=None) -> bytes``."""
        raise NotImplementedError

    def finished(self, stream: Any) -> None:
        """After a stream translator closed (the Responses store keeps the answer)."""

    def wrap(self, send: Send) -> Send:
        return _TranslatingSend(self, send)


class _TranslatingSend:
    """The endpoint's ``send``, translating what it sends: the response start is held until the first body
    piece says what follows (an error, a JSON answer or a stream)."""

    __slots__ = ("_buffer", "_ended", "_send", "_start", "_stream", "_translated", "_translation")

    def __init__(self, translation: Translation, send: Send) -> None:
        self._translation = translation
        self._send = send
        self._start: Message | None = None
        self._buffer: list[bytes] = []
        self._stream: Any = None
        self._translated = 0  # parse units of the stream's large events translated so far
        self._ended = False

    def _too_costly(self, body: bytes) -> str | None:
        """Why the stream's events in ``body`` cost too much to translate (item by item, in Python, ~0.35 us a
        parse unit: one 1 MB chunk of 333,000 logprob entries held the event loop 0.67 s, sweep 10), or None. Only
        events over ``BIG_EVENT_BYTES`` are counted: an engine's chunk is a token or two."""
        for event in body.split(b"\n\n") if len(body) > BIG_EVENT_BYTES else ():
            if len(event) > BIG_EVENT_BYTES:
                units = parse_units(event)
                self._translated += units
                if units > MAX_EVENT_UNITS or self._translated > MAX_STREAM_UNITS:
                    return "the backend's stream carried events too large to translate"
        return None

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self._start = message
            return
        if kind != "http.response.body":
            await self._send(message)
            return
        start = self._start
        translation = self._translation
        if start is not None and self._stream is None:
            content_type = dict(start.get("headers", [])).get(b"content-type", b"")
            if start["status"] == 200 and content_type.startswith(b"text/event-stream"):
                self._stream = StreamTap(translation.api) if translation.passthrough else translation.stream()
                self._start = None
                await self._send(start)
        body: bytes = message.get("body", b"")
        more = bool(message.get("more_body", False))
        stream = self._stream
        if isinstance(stream, StreamTap):  # the engine's own stream, relayed as it came (see StreamTap.feed)
            relayed = stream.feed(body)
            if not more:
                translation.passed(stream.usage, stream.response)
            await self._send(message if relayed is body else {**message, "body": relayed})
            return
        if stream is not None:
            if self._ended:
                return  # (the translation failed the stream: the client's response is over)
            costly = self._too_costly(body) if body else None
            failed = False
            try:
                out = stream.close(costly) if costly is not None else stream.feed(body) if body else b""
            except _SHAPE_ERRORS as exc:  # (the engine's stream held a value of a type chat never has there)
                out, failed = _closed_on(stream, exc), True
            if more and (stream.closed or failed):
                # failed mid-way (too costly, too long, an error event): the client's response ends here, and the
                # engine's answer is let go (the server then says the client is gone, and the request's upstream is
                # cancelled; it held the connection and its backend slot until the engine stopped, sweep 14)
                more = False
                self._ended = True
            if not more:
                if not failed:
                    try:
                        out += stream.close()
                    except _SHAPE_ERRORS as exc:
                        out += _closed_on(stream, exc)
                self._translation.finished(stream)
            if out or not more:
                await self._send({"type": "http.response.body", "body": out, "more_body": more})
            return
        self._buffer.append(body)
        if more:
            return
        raw = b"".join(self._buffer)
        self._buffer.clear()
        assert start is not None, "a body before its response start"
        status = start["status"]
        if status == 200:
            # (counted before it is parsed again: sweep 15's 1.5M keys were parsed before they were refused)
            too_big = not translation.passthrough and len(raw) > BIG_EVENT_BYTES and parse_units(raw) > MAX_ANSWER_UNITS
            try:
                doc = None if too_big else orjson.loads(raw)
            except orjson.JSONDecodeError:
                doc = None
            if not isinstance(doc, dict) and not too_big:
                status, raw = 502, translation.error(502, GatewayError(
                    502, "the backend's answer is not a JSON object", code="upstream_failed").body())
            elif too_big:
                # translated item by item in Python, ~0.35 us a parse unit: 714,000 empty tool calls held the event
                # loop 2.8 s (sweep 10)
                status, raw = 502, translation.error(502, GatewayError(
                    502, f"the backend's answer has more than {MAX_ANSWER_UNITS} JSON values weighted by their cost "
                         "(server.max_response_values' units): too large to translate to this API; ask for less, "
                         "or use chat completions", code="upstream_response_too_large").body())
            elif translation.passthrough:
                assert isinstance(doc, dict)
                translation.passed(doc.get("usage"), doc)
            else:
                assert isinstance(doc, dict)
                try:
                    raw = orjson.dumps(translation.answer(doc))
                except _SHAPE_ERRORS as exc:
                    status, raw = 502, translation.error(502, _untranslatable(exc).body())
        else:
            try:
                raw = translation.error(status, raw)
            except _SHAPE_ERRORS as exc:
                status, raw = 502, translation.error(502, _untranslatable(exc).body())
        headers = [(k, v) for k, v in start.get("headers", []) if k not in (b"content-length", b"content-type")]
        await self._send({"type": "http.response.start", "status": status,
                          "headers": [(b"content-type", _JSON), (b"content-length", str(len(raw)).encode()),
                                      *headers]})
        await self._send({"type": "http.response.body", "body": raw, "more_body": False})


class _Messages(Translation):
    api = "messages"
    items = "messages"
    native_api = MESSAGES

    def __init__(self) -> None:
        self._model = ""
        self._stops: list[str] | None = None
        self._body: dict[str, Any] = {}
        self._omit_thinking = False

    def native_body(self) -> dict[str, Any] | None:
        return self._body

    def native(self, backend: Backend) -> tuple[bytes, NativeApi] | None:
        """As :meth:`Translation.native`, and only where the engine's own Messages accepts what this request
        uses (``EngineSpec.native_messages``): else the translation, which the engine would not refuse."""
        if not _messages_features(self._body) <= backend.spec.native_messages:
            self.passthrough = False
            return None
        return super().native(backend)

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self._body = body
        chat = messages_to_chat(body)
        self._model = str(body.get("model", ""))
        stops = body.get("stop_sequences")
        self._stops = stops if isinstance(stops, list) else None
        thinking = body.get("thinking")
        self._omit_thinking = isinstance(thinking, dict) and thinking.get("display") == "omitted"
        return chat

    def error(self, status: int, body: bytes) -> bytes:
        return anthropic_error_from_openai(status, body)

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        return chat_to_message(chat, self._model, self._omit_thinking)

    def stream(self) -> MessagesStream:
        return MessagesStream(self._model, self._stops, self._omit_thinking)


def _messages_features(body: dict[str, Any]) -> frozenset[str]:
    """What a Messages request uses that not every engine's own Messages accepts (``EngineSpec.native_messages``)."""
    features = set()
    messages = body.get("messages")
    if isinstance(messages, list) and any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        features.add("inline_system")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "enabled", "disabled"):
        features.add(f"thinking:{thinking.get('type')}")
    if isinstance(thinking, dict) and thinking.get("display") == "omitted":
        features.add("thinking:omitted")  # (no engine's own Messages leaves the reasoning out)
    tools = body.get("tools")
    if isinstance(tools, list) and any(isinstance(t, dict) and t.get("defer_loading") for t in tools):
        features.add("defer_loading")  # (nor keeps a deferred tool from the model)
    if body.get("context_management") is not None and thinking_turns_kept(body["context_management"]) is not None:
        # an edit that clears earlier turns' reasoning: no engine's own Messages reads context_management
        # (llama-server's conversion leaves it out, vLLM's and SGLang's request models have no such field and
        # drop it); Claude Code's keep "all" clears nothing, and passes
        features.add("context_management:clear_thinking")
    return frozenset(features)


class _CountTokens(_Messages):
    """``/v1/messages/count_tokens``: counted with the model's own tokenizer and template, never estimated. An
    engine that serves the route gets the request as sent; one that only tokenizes chat messages
    (``EngineSpec.chat_tokenize_path``: TabbyAPI) gets the chat translation, and its count is answered in
    Anthropic's shape (what that leaves out: ``gateway.api.translate.count_tokens``). A model no engine can
    count for is refused."""

    api = "count_tokens"
    native_api = COUNT_TOKENS

    def __init__(self) -> None:
        super().__init__()
        self._chat: dict[str, Any] = {}

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self._body = body
        self._model = str(body.get("model", ""))
        chat = count_tokens_chat(body)
        self._chat = chat
        return {**chat, "max_tokens": 1}  # (the chat translation only serves routing and limits here)

    def _counted(self) -> dict[str, Any]:
        """The body as the engine's own count_tokens gets it: without what changes no count but an engine may
        not read (``thinking.display``), and without the deferred tools no tool search has loaded (the model
        does not see them: messages.py)."""
        body = self._body
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and "display" in thinking:
            body = {**body, "thinking": {k: v for k, v in thinking.items() if k != "display"}}
        tools = body.get("tools")
        if isinstance(tools, list) and any(isinstance(t, dict) and "defer_loading" in t for t in tools):
            offered = {t["function"]["name"] for t in self._chat.get("tools") or ()}
            kept = [{k: v for k, v in t.items() if k != "defer_loading"} for t in tools
                    if isinstance(t, dict) and (not t.get("defer_loading") or t.get("name") in offered)]
            body = {**body, "tools": kept} if kept else {k: v for k, v in body.items() if k != "tools"}
        return body

    def _native_count(self, spec: EngineSpec) -> bool:
        """Whether the engine's own count_tokens takes this request (SGLang's refuses a system message inside
        messages, and thinking adaptive: ``EngineSpec.native_messages``)."""
        return self.api in spec.native_apis and _messages_features(self._counted()) <= spec.native_messages

    def servable(self, spec: EngineSpec) -> bool:
        return self._native_count(spec) or (spec.chat_tokenize_path is not None and countable(self._chat))

    def native(self, backend: Backend) -> tuple[bytes, NativeApi] | None:
        self.passthrough = True
        spec = backend.spec
        if not self._native_count(spec) and spec.chat_tokenize_path is not None:
            return orjson.dumps(encode_request(self._chat)), replace(TOKENIZED_COUNT, path=spec.chat_tokenize_path)
        request = self.route_request  # (the model it resolved to: an alias's target, a fallback)
        body = self._counted()
        body = body if request is None else {**body, "model": request.model}
        return orjson.dumps(body), self.native_api

    def passed(self, usage: Any, response: dict[str, Any] | None) -> None:
        if self.exchange is not None:  # a count generates nothing and reads no cache
            self.exchange.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


class _Responses(Translation):
    api = "responses"
    items = "input"
    native_api = RESPONSES

    def __init__(self, store: ResponseStore) -> None:
        self._store = store
        self._request: dict[str, Any] = {}
        self._conversation: list[dict[str, Any]] = []
        self._id = new_response_id()

    async def load(self, body: dict[str, Any], limits: LimitSettings, room: int) -> dict[str, Any]:
        check_depth(body, limits, constraints=False)
        _bounded(body, self.items, limits)
        previous = body.get("previous_response_id")
        history: list[dict[str, Any]] | None = None
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                raise GatewayError(400, "'previous_response_id' must be a non-empty string",
                                   param="previous_response_id", code="invalid_value")
            raw = await self._store.fetch_raw(self._owner(), previous)
            if raw is not None and len(raw) > room:
                # (a conversation grows with every turn kept: it goes to the engine whole, so it is bounded as a
                # request body is; reasoning items the engine counts as no tokens grew one to 4x the body limit)
                raise GatewayError(400, f"The conversation up to '{previous}' is {len(raw)} bytes, and with "
                                        "this input more than the gateway's request body limit "
                                        "(server.max_body_bytes): start a new conversation, or send the turns "
                                        "you want kept as input", param="previous_response_id",
                                   code="conversation_too_large")
            if raw is not None and len(raw) > BIG_EVENT_BYTES and parse_units(raw) > limits.max_json_values:
                # (decoded and translated with the input in one turn of the event loop, as a body is: bounded as
                # one is; three chained inputs of 90,000 parts held the loop 0.2-0.3 s each, sweep 15)
                raise GatewayError(400, f"The conversation up to '{previous}' holds more JSON values than the "
                                        f"gateway decodes in one request (limits.max_json_values = "
                                        f"{limits.max_json_values}, weighted by their cost): start a new "
                                        "conversation, or send the turns you want kept as input",
                                   param="previous_response_id", code="conversation_too_large")
            history = decode_conversation(raw) if raw is not None else None
            if history is None:  # (unknown, expired, or another key's: the same answer)
                raise GatewayError(404, f"Previous response with id '{previous}' not found.",
                                   type="invalid_request_error", param="previous_response_id",
                                   code="previous_response_not_found")
            self.history_size = len(raw or b"")
        return _translated(lambda b: self._translate(b, history), body)

    def _owner(self) -> str:
        """Whose stored responses this request may continue and keeps to: its API key's ("" with auth off)."""
        client = self.exchange.client if self.exchange is not None else None
        return client.name if client is not None else ""

    def _translate(self, body: dict[str, Any], history: list[dict[str, Any]] | None) -> dict[str, Any]:
        chat = responses_to_chat(body, history)
        self._request = body
        left_out = omitted(body.get("tools"))
        if left_out:  # (web_search: not offered to the model, and the client told)
            self.notes = ((b"x-gateway-tools-omitted", ", ".join(left_out).encode()),)
        if body.get("store", True) is not False:
            self._conversation = [*(history or []), *input_messages(body)]
        return chat

    def error(self, status: int, body: bytes) -> bytes:
        """OpenAI's shape already; the fields it names are the chat translation's, renamed to the ones the client
        sent (``max_output_tokens``, ``input``, ``text.format``)."""
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return body
        error = doc.get("error") if isinstance(doc, dict) else None
        if not isinstance(error, dict):
            return body
        param, message = error.get("param"), error.get("message")
        renamed = {**error}
        if isinstance(param, str):
            renamed["param"] = _responses_field(param)
        if isinstance(message, str):
            renamed["message"] = _CHAT_FIELD.sub(lambda m: _responses_field(m[0]), message)
        return body if renamed == error else orjson.dumps({**doc, "error": renamed})

    def native_body(self) -> dict[str, Any] | None:
        """The request as the client sent it (less its ``client_metadata``), when it continues no stored response
        (the conversation is kept in chat form, so a continuation is translated) and has no namespace of tools;
        the engine is told not to keep its own copy."""
        if self._request.get("previous_response_id") is not None or _has_namespace(self._request):
            return None
        body = {**self._request, "store": False}
        body.pop("client_metadata", None)  # (bookkeeping for the client's logs: no engine reads it)
        if self.notes:  # (the built-in tools no engine runs are left out here too)
            tools = [t for t in body.get("tools") or () if not (isinstance(t, dict) and is_omitted(t.get("type")))]
            body["tools"] = tools
            if not tools:
                del body["tools"]
        return body

    def passed(self, usage: Any, response: dict[str, Any] | None) -> None:
        super().passed(usage, response)
        if response is not None and response.get("status") in ("completed", "incomplete"):
            self._keep(response)

    def _keep(self, response: dict[str, Any] | None) -> None:
        if response is not None and self._request.get("store", True) is not False:
            # under the id the client was given (an engine's own, when it was passed through)
            rid = response.get("id")
            self._store.put(self._owner(), rid if isinstance(rid, str) and rid else self._id,
                            [*self._conversation, *output_messages(response)])

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        response = chat_to_response(chat, self._request, self._id)
        self._keep(response)
        return response

    def stream(self) -> ResponsesStream:
        return ResponsesStream(self._request, self._id)

    def finished(self, stream: Any) -> None:
        response = stream.response
        if isinstance(response, dict) and response.get("status") in ("completed", "incomplete"):
            self._keep(response)


def _has_namespace(request: dict[str, Any]) -> bool:
    """Whether the request groups tools in a namespace: the gateway flattens it and maps its calls back (no
    engine's own Responses route is known to)."""
    tools = request.get("tools")
    return isinstance(tools, list) and any(isinstance(t, dict) and t.get("type") == "namespace" for t in tools)


# chat fields a Responses request was translated to, and what the client called them
_CHAT_FIELD = re.compile(r"\b(?:max_completion_tokens|max_tokens|response_format(?:\.json_schema(?:\.schema)?)?)\b")


def _responses_field(name: str) -> str:
    if name in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if name == "messages":  # (not messages[i]: the instructions and the stored turns shift the indices)
        return "input"
    if name.startswith("tools[") and ".function." in name:  # (Responses function tools are flat)
        return name.replace(".function.", ".", 1)
    if name.startswith("response_format"):
        rest = name[len("response_format"):].removeprefix(".json_schema")
        return "text.format" + rest
    return name


class AgentApi:
    """One agent API route: its name (the route label in metrics, logs and traces) and a :class:`Translation`
    per request. ``history``: the bytes of the stored conversation a request of an owner continues, as this
    process holds it (for its key's reservation, before the request is decoded); 0 when none."""

    def __init__(self, name: str, new: Callable[[], Translation],
                 history: Callable[[str, str], int] | None = None) -> None:
        self.name = name
        self.new = new
        self._history = history

    def history_bytes(self, owner: str, previous: str | None) -> int:
        return self._history(owner, previous) if self._history is not None and previous else 0


def messages_api() -> AgentApi:
    return AgentApi("messages", _Messages)


def count_tokens_api() -> AgentApi:
    return AgentApi("count_tokens", _CountTokens)


def responses_api(store: ResponseStore) -> AgentApi:
    return AgentApi("responses", lambda: _Responses(store), store.held_bytes)
