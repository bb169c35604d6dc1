"""The agent routes an engine serves natively: OpenAI Responses (``/v1/responses``) and Anthropic Messages
(``/v1/messages``, ``/v1/messages/count_tokens``), built on the engine's own chat generation.

Each request is turned into the chat request the real engine turns it into (vLLM's
``_convert_anthropic_to_openai_request``, llama.cpp's ``convert_anthropic_to_oai`` / responses conversion), then
rendered, planned (tool call, reasoning, structured output), scheduled and timed exactly like a chat request;
only the request parsing and the response shapes (:mod:`gateway.sim.responses_shapes`,
:mod:`gateway.sim.messages_shapes`) are the route's. An engine declares what it serves with an
:class:`AgentSpec`; an engine without one (TabbyAPI) answers these paths with its 404.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson

from gateway.sim import messages_shapes, responses_shapes
from gateway.sim.engines.base import CollectSink, EngineError, Gen, Handler, new_id
from gateway.sim.generation import Constraint, Plan
from gateway.sim.http import Request, Responder
from gateway.sim.scheduler import ContextTooLong, Sequence
from gateway.sim.template import content_text, render_chat

if TYPE_CHECKING:
    from gateway.sim.engines.openai import OpenAIEngine


@dataclass(frozen=True)
class AgentSpec:
    """Which agent routes an engine serves, and in whose shapes.

    ``responses``: ``/v1/responses`` in llama.cpp's terse shape or the full OpenAI shape vLLM and SGLang send;
    ``messages``: ``/v1/messages`` as llama.cpp or vLLM (SGLang's is vLLM's port) shape it; ``count_tokens``:
    ``/v1/messages/count_tokens``; ``input_tokens``: llama.cpp's ``/v1/responses/input_tokens``; ``store``: the
    most responses kept for ``GET /v1/responses/{id}`` (0: no such route).
    """

    responses: Literal["llamacpp", "openai"] | None = None
    messages: Literal["llamacpp", "vllm"] | None = None
    count_tokens: bool = False
    input_tokens: bool = False
    store: int = 0
    salted: frozenset[str] = frozenset()  # the routes ("responses", "messages") that pass cache_salt on
    # its Messages: a {"role": "system"} message inside messages folded in (llama-server, vLLM) or refused
    # (SGLang's protocol declares user and assistant only); the thinking types taken (None: any)
    inline_system: bool = True
    thinking_types: frozenset[str] | None = None


class StreamWriter(Protocol):
    """A route's stream: bytes before the first token, per token (index, text) and after the last."""

    def head(self) -> bytes: ...

    def token(self, index: int, piece: str) -> bytes: ...

    def tail(self) -> bytes: ...


class _StreamSink:
    __slots__ = ("done", "drop_after", "resp", "writer")

    def __init__(self, writer: StreamWriter, resp: Responder, done: asyncio.Future[None],
                 drop_after: int | None = None) -> None:
        self.writer, self.resp, self.done = writer, resp, done
        self.drop_after = drop_after  # the drop_mid_stream_after_tokens fault, as on chat streams

    def on_token(self, seq: Sequence) -> None:
        n = seq.generated
        data = self.writer.token(n - 1, seq.output[n - 1])
        if data:
            self.resp.chunk(data)
        if self.drop_after is not None and n >= self.drop_after and n < len(seq.output):
            self.resp.abort()

    def on_finish(self, seq: Sequence) -> None:
        self.resp.chunk(self.writer.tail())
        self.resp.end_stream()
        if not self.done.done():
            self.done.set_result(None)


# -- request conversion: Responses / Messages -> the chat request the engine generates for ----------------------
def _function_tool(name: Any, description: Any, parameters: Any) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise EngineError(400, "each tool needs a name", param="tools")
    return {"type": "function", "function": {"name": name, "description": description or "",
                                             "parameters": parameters if isinstance(parameters, dict) else {}}}


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """``instructions`` + ``input`` (a string, or message / function_call / function_call_output items),
    flat ``tools``, ``tool_choice``, ``max_output_tokens`` -> a chat request."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                raise EngineError(400, "each input item must be an object", param="input")
            kind = item.get("type", "message")
            if kind == "message":
                messages.append({"role": item.get("role", "user"), "content": content_text(item.get("content"))})
            elif kind == "function_call":
                call = {"id": item.get("call_id", ""), "type": "function",
                        "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                                 "content": content_text(item.get("output"))})
            elif kind != "reasoning":  # earlier reasoning items are dropped from the prompt
                raise EngineError(400, f"unsupported input item type: {kind}", param="input")
    else:
        raise EngineError(400, "'input' must be a string or a list of items", param="input")
    if not messages:
        raise EngineError(400, "'input' must not be empty", param="input")
    tools = [_function_tool(t.get("name"), t.get("description"), t.get("parameters"))
             for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type") == "function"]
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat: dict[str, Any] = {"messages": messages, "tools": tools or None, "tool_choice": choice}
    _copy(body, chat, ("chat_template_kwargs", "reasoning", "model"))
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


def responses_constraint(body: dict[str, Any]) -> Constraint | None:
    """``text.format``: ``json_schema`` (its ``schema``) or ``json_object``."""
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_schema":
        schema = fmt.get("schema")
        return Constraint("json", schema if isinstance(schema, dict) else {"type": "object"})
    if fmt["type"] == "json_object":
        return Constraint("json_object", None)
    raise EngineError(400, f"unsupported text.format type: {fmt['type']}", param="text.format")


def messages_to_chat(body: dict[str, Any], need_max_tokens: bool = True, spec: AgentSpec | None = None
                     ) -> dict[str, Any]:
    """Anthropic ``system``, ``messages`` (text / tool_use / tool_result blocks), ``tools`` (``input_schema``),
    ``tool_choice`` (auto / any / tool / none), ``max_tokens``, ``stop_sequences`` -> a chat request. ``spec``:
    what the engine's Messages accepts beyond user and assistant turns (default: nothing more)."""
    inline = spec is not None and spec.inline_system
    thinking = body.get("thinking")
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind is not None and spec is not None and spec.thinking_types is not None and kind not in spec.thinking_types:
        raise EngineError(400, f"thinking.type: input should be {' or '.join(sorted(spec.thinking_types))}",
                          param="thinking.type")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": content_text(system)})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise EngineError(400, "messages: field required, a non-empty list", param="messages")
    for msg in raw:
        roles = ("user", "assistant", "system") if inline else ("user", "assistant")
        if not isinstance(msg, dict) or msg.get("role") not in roles:
            raise EngineError(400, f"each message needs role {' or '.join(repr(r) for r in roles)}",
                              param="messages")
        content = msg.get("content")
        if isinstance(content, str):
            messages.append({"role": msg["role"], "content": content})
            continue
        text, calls = [], []
        for block in content if isinstance(content, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use":
                calls.append({"id": block.get("id", ""), "type": "function",
                              "function": {"name": block.get("name", ""),
                                           "arguments": orjson.dumps(block.get("input") or {}).decode()}})
            elif kind == "tool_result":
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""),
                                 "content": content_text(block.get("content"))})
        if text or calls:
            messages.append({"role": msg["role"], "content": "".join(text),
                             **({"tool_calls": calls} if calls else {})})
    tools = [_function_tool(t.get("name"), t.get("description"), t.get("input_schema"))
             for t in body.get("tools") or [] if isinstance(t, dict)]
    choice: Any = "auto"
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        choice = {"auto": "auto", "any": "required", "none": "none"}.get(tc.get("type", "auto"), "auto")
        if tc.get("type") == "tool":
            choice = {"type": "function", "function": {"name": tc.get("name")}}
    chat: dict[str, Any] = {"messages": messages, "tools": tools or None, "tool_choice": choice}
    _copy(body, chat, ("chat_template_kwargs", "model"))
    mt = body.get("max_tokens")
    if need_max_tokens and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise EngineError(400, "max_tokens: field required, an integer >= 1", param="max_tokens")
    chat["max_tokens"] = mt
    return chat


def _copy(src: dict[str, Any], dst: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        if key in src:
            dst[key] = src[key]


def cut_at_stop(plan: Plan, stops: list[str]) -> tuple[Plan, str | None]:
    """The plan ended just before the first stop sequence in its answer (the engine stops there, unsent)."""
    answer = "".join(plan.pieces[plan.reasoning:])
    hits = [(answer.find(s), s) for s in stops if s and s in answer]
    if not hits:
        return plan, None
    at, word = min(hits)
    pieces, ids, length = list(plan.pieces[: plan.reasoning]), list(plan.ids[: plan.reasoning]), 0
    for piece, tid in zip(plan.pieces[plan.reasoning:], plan.ids[plan.reasoning:], strict=True):
        if length + len(piece) > at:
            if at > length:
                pieces.append(piece[: at - length])
                ids.append(tid)
            break
        pieces.append(piece)
        ids.append(tid)
        length += len(piece)
    if not pieces:
        pieces, ids = [""], [plan.ids[0]]
    return Plan(pieces, ids, "stop", plan.reasoning), word


class AgentRoutes:
    """The agent routes of one engine (``spec``), generating with that engine; keeps the bounded response store."""

    def __init__(self, engine: OpenAIEngine, spec: AgentSpec) -> None:
        self.engine = engine
        self.spec = spec
        self.store: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def routes(self) -> dict[tuple[str, str], Handler]:
        r: dict[tuple[str, str], Handler] = {}
        if self.spec.responses:
            r[("POST", "/v1/responses")] = self.responses
        if self.spec.input_tokens:
            r[("POST", "/v1/responses/input_tokens")] = self.input_tokens
        if self.spec.messages:
            r[("POST", "/v1/messages")] = self.messages
        if self.spec.count_tokens:
            r[("POST", "/v1/messages/count_tokens")] = self.count_tokens
        return r

    def match(self, method: str, path: str) -> Handler | None:
        """``GET /v1/responses/{id}`` when the engine keeps responses."""
        rid = path.removeprefix("/v1/responses/")
        if self.spec.store and method == "GET" and rid != path and rid and "/" not in rid:
            return partial(self.get_response, rid)
        return None

    # -- shared: prompt, plan, run ---------------------------------------------------------------------------------
    def salt(self, body: dict[str, Any], chat: dict[str, Any], route: str) -> None:
        """The route's ``cache_salt`` onto the chat request it became, where the engine passes it on (vLLM's
        Responses and Messages, SGLang's Responses; SGLang's Messages build a chat request without it)."""
        if route in self.spec.salted and "cache_salt" in body:
            chat["cache_salt"] = body["cache_salt"]

    def prompt_ids(self, chat: dict[str, Any]) -> list[int]:
        eng, hf = self.engine, self.engine.server.hf
        if hf is not None:
            return hf.encode(eng.render_hf(chat), add_special_tokens=False)
        return eng.server.tokenizer.encode(render_chat(chat["messages"], chat.get("tools")))

    def new_gen(self, chat: dict[str, Any], stream: bool, gen_id: str,
                constraint: Constraint | None = None) -> tuple[Gen, list[int]]:
        eng = self.engine
        eng.check_model(chat)
        ids = self.prompt_ids(chat)
        max_tokens = eng.max_tokens(chat)
        try:
            max_tokens = eng.context_room(len(ids), max_tokens)
        except ContextTooLong as exc:
            raise eng.context_error(exc, len(ids), max_tokens) from exc
        tool, reasoning = eng.agent(chat, ids)
        if tool is not None:
            constraint = Constraint("json", tool.schema)
        try:
            plan = eng.plan(ids, max_tokens, constraint, reasoning=reasoning)
        except ValueError as exc:
            raise eng.constraint_error(exc) from exc
        try:
            eng.server.scheduler.check(len(ids), len(plan.ids) if max_tokens is None else max_tokens)
        except ContextTooLong as exc:
            raise eng.context_error(exc, len(ids), max_tokens) from exc
        gen = Gen(id=gen_id, model=eng.model, kind="agent", stream=stream, include_usage=True, plan=plan,
                  prompt_len=len(ids), scale=eng.spec.time_scale, body=chat, salt=eng.cache_salt(chat))
        if tool is not None:
            gen.tool, gen.tool_id, gen.tool_finish = tool, eng.new_tool_id(), eng.tool_finish(tool)
        return gen, ids

    async def run(self, gen: Gen, ids: list[int], resp: Responder, writer: StreamWriter | None) -> bool:
        """Generate on the engine's scheduler; streamed through ``writer`` or collected. True when it finished."""
        server = self.engine.server
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sink = (_StreamSink(writer, resp, done, server.faults.drop_mid_stream_after_tokens) if writer is not None
                else CollectSink(done))
        seq = Sequence(ids, gen.plan.pieces, gen.plan.ids, gen.plan.finish_reason, sink)
        seq.salt = gen.salt
        gen.seq = seq

        def on_close() -> None:
            server.scheduler.abort(seq)
            if not done.done():
                done.set_result(None)

        resp.on_close.append(on_close)
        if writer is not None:
            resp.start_stream()
            head = writer.head()
            if head:
                resp.chunk(head)
        server.scheduler.submit(seq)
        await done
        return not resp.closed and seq.state == "done"

    # -- handlers ------------------------------------------------------------------------------------------------------
    async def responses(self, req: Request, resp: Responder) -> None:
        body = self.engine.parse_json(req)
        chat = responses_to_chat(body)
        self.salt(body, chat, "responses")
        stream = bool(body.get("stream"))
        gen, ids = self.new_gen(chat, stream, new_id("resp_"), responses_constraint(body))
        assert self.spec.responses is not None
        shape = responses_shapes.ResponseShape(self.spec.responses, gen, body, self.engine.spec.cache_report)
        if not await self.run(gen, ids, resp, shape if stream else None):
            return
        final = shape.response("completed")
        if self.spec.store and body.get("store", True) is not False:
            self.store[gen.id] = final
            while len(self.store) > self.spec.store:
                self.store.popitem(last=False)
        if not stream:
            self.engine.send_json(resp, final)

    async def get_response(self, rid: str, req: Request, resp: Responder) -> None:
        found = self.store.get(rid)
        if found is None:
            raise EngineError(404, f"Response with id '{rid}' not found.", "invalid_request", param="response_id")
        self.engine.send_json(resp, found)

    async def input_tokens(self, req: Request, resp: Responder) -> None:
        ids = self.prompt_ids(responses_to_chat(self.engine.parse_json(req)))
        self.engine.send_json(resp, {"object": "response.input_tokens", "input_tokens": len(ids)})

    async def messages(self, req: Request, resp: Responder) -> None:
        assert self.spec.messages is not None
        try:
            body = self.engine.parse_json(req)
            chat = messages_to_chat(body, spec=self.spec)
            self.salt(body, chat, "messages")
            stops = body.get("stop_sequences") or []
            gen, ids = self.new_gen(chat, bool(body.get("stream")), new_id("chatcmpl-"))
        except EngineError as err:
            self.send_messages_error(resp, err)
            return
        word = None
        if gen.tool is None and isinstance(stops, list):
            gen.plan, word = cut_at_stop(gen.plan, [s for s in stops if isinstance(s, str)])
        shape = messages_shapes.MessageShape(self.spec.messages, gen, word, self.engine.spec.cache_report)
        if await self.run(gen, ids, resp, shape if gen.stream else None) and not gen.stream:
            self.engine.send_json(resp, shape.message())

    async def count_tokens(self, req: Request, resp: Responder) -> None:
        try:
            chat = messages_to_chat(self.engine.parse_json(req), need_max_tokens=False, spec=self.spec)
            self.engine.check_model(chat)
        except EngineError as err:
            self.send_messages_error(resp, err)
            return
        self.engine.send_json(resp, {"input_tokens": len(self.prompt_ids(chat))})

    def send_messages_error(self, resp: Responder, err: EngineError) -> None:
        """vLLM's Anthropic router answers ``{"type": "error", "error": {type, message}}``; llama.cpp its own."""
        if self.spec.messages == "llamacpp":
            self.engine.send_error(resp, err)
            return
        self.engine.server.stats.errors += 1
        native = orjson.loads(self.engine.error_body(err))
        inner = native.get("error") if isinstance(native.get("error"), dict) else native
        err_type = inner.get("type")
        resp.send(err.status, orjson.dumps({"type": "error", "error": {"type": err_type or "BadRequestError",
                                                                       "message": err.message}}))
