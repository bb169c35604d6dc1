"""What every emulated engine shares: request context, error type, SSE framing and the generation driver.

An engine module (``llamacpp.py``, ``vllm.py``, ...) subclasses :class:`Engine`: it declares its routes, auth
rule, error body and chunk shapes as data and small methods; :func:`drive` runs one generation through the
server's scheduler and streams it with those shapes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from gateway.sim.agent import ToolPick
from gateway.sim.generation import Plan
from gateway.sim.http import Request, Responder
from gateway.sim.prefix_cache import PrefixCache
from gateway.sim.profiles import Profile
from gateway.sim.scheduler import Sequence

if TYPE_CHECKING:
    from gateway.sim.server import SimServer

Handler = Callable[[Request, Responder], Awaitable[None]]
_MARK = "\x00PIECE\x00"
_MARK_JSON = orjson.dumps(_MARK)
Event = dict[str, Any] | bytes


class EngineError(Exception):
    """A request the engine refuses. ``kind``: invalid_request, auth, not_found, unavailable, server, not_supported."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param


@dataclass
class Gen:
    """One generation request as the formatters see it."""

    id: str
    model: str
    kind: str  # "chat" | "completion" | "native"
    stream: bool
    include_usage: bool
    plan: Plan
    prompt_len: int
    scale: float
    body: dict[str, Any]
    created: int = field(default_factory=lambda: int(time.time()))
    seq: Sequence | None = None
    tool: ToolPick | None = None  # the answer is this tool call; its arguments are the planned pieces
    tool_id: str = ""
    tool_finish: str = "tool_calls"  # finish_reason of a tool call that stopped on its own
    rank: int = 0  # its place in the engine's waiting queue: lower runs first (priority scheduling)
    salt: str | None = None  # its cache salt, where the engine honours one (Engine.cache_salt)

    @property
    def completion_tokens(self) -> int:
        return self.seq.generated if self.seq else 0

    @property
    def cached(self) -> int:
        return self.seq.cached if self.seq else 0

    @property
    def finish_reason(self) -> str:
        reason = self.seq.finish_reason if self.seq else "stop"
        return self.tool_finish if self.tool is not None and reason == "stop" else reason

    @property
    def reasoning_tokens(self) -> int:
        return min(self.plan.reasoning, self.completion_tokens)

    @property
    def reasoning_text(self) -> str:
        return "".join(self.plan.pieces[: self.reasoning_tokens])

    @property
    def text(self) -> str:
        """The answer (tool call arguments for a tool call), without the reasoning."""
        return "".join(self.plan.pieces[self.plan.reasoning: self.completion_tokens])

    def prompt_seconds(self) -> float:
        s = self.seq
        return max(0.0, s.t_first - s.t_scheduled) if s else 0.0

    def decode_seconds(self) -> float:
        s = self.seq
        return max(0.0, s.t_last - s.t_first) if s else 0.0

    def queue_seconds(self) -> float:
        s = self.seq
        return max(0.0, s.t_scheduled - s.t_arrival) if s else 0.0


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def template(obj: dict[str, Any]) -> tuple[bytes, bytes]:
    """Split a chunk's JSON around the placeholder ``_MARK`` so a token costs one concatenation."""
    raw = orjson.dumps(obj)
    head, _, tail = raw.partition(_MARK_JSON)
    return head, tail


class Engine:
    """Base for the four engines. Subclasses fill the class attributes and override the shape methods."""

    name = "engine"
    line_end = b"\n"
    done_after_error = True
    ping_at_start = False
    owned_by = "sim"
    listen_after_load_fraction = 1.0  # share of the load time spent not listening at all
    generation_paths: frozenset[str] = frozenset()
    # the engine's 401 body when it is not its ordinary error shape (FastAPI-based servers answer their own)
    unauthorized_body: bytes | None = None

    def __init__(self, server: SimServer) -> None:
        self.server = server
        self.spec = server.spec
        self.model = server.spec.model

    # -- data a subclass provides ----------------------------------------------------------------------------
    def make_cache(self, profile: Profile) -> PrefixCache:
        raise NotImplementedError

    def dynamic_token(self, gen: Gen, seq: Sequence) -> bytes | None:
        """A token event that is not a fixed template (e.g. cumulative text); None: use ``token_chunk``."""
        return None

    def routes(self) -> dict[tuple[str, str], Handler]:
        raise NotImplementedError

    def match_route(self, method: str, path: str) -> Handler | None:
        """A route with a parameter in its path (``GET /v1/responses/{id}``); None: not served."""
        return None

    def authorized(self, req: Request) -> bool:
        return True

    def queue_rank(self, body: dict[str, Any]) -> int:
        """Where the request waits in the scheduler's queue, lower first (engines with priority scheduling
        read the request's ``priority``; the others queue in arrival order)."""
        return 0

    def cache_salt(self, body: dict[str, Any]) -> str | None:
        """The request's cache salt, for engines that partition their prefix cache by one (vLLM's and SGLang's
        ``cache_salt``); the others ignore the field. Raises EngineError where the engine refuses it."""
        return None

    def requested_slot(self, gen: Gen) -> int | None:
        """The engine slot the request names, for engines that take one (llama.cpp's ``id_slot``)."""
        return None

    def error_body(self, err: EngineError) -> bytes:
        raise NotImplementedError

    def unauthorized(self, resp: Responder) -> None:
        if self.unauthorized_body is None:
            self.send_error(resp, EngineError(401, "Unauthorized", "auth"))
            return
        self.server.stats.errors += 1
        resp.send(401, self.unauthorized_body)

    def loading(self, req: Request, resp: Responder) -> None:
        """Answer while the model loads (only reached by engines whose HTTP server is up then)."""
        self.send_error(resp, EngineError(503, "Loading model", "unavailable"))

    def token_chunk(self, gen: Gen) -> dict[str, Any] | None:
        """A chunk carrying one answer token, with ``_MARK`` where the token's text goes; None: tokens of this
        answer are not streamed one by one (TabbyAPI's tool calls)."""
        raise NotImplementedError

    def reasoning_chunk(self, gen: Gen) -> dict[str, Any]:
        """A chunk carrying one reasoning token, with ``_MARK`` where its text goes (reasoning models only)."""
        raise NotImplementedError

    def answer_start_events(self, gen: Gen) -> list[Event]:
        """Events sent once, just before the first answer token (a tool call's id and name)."""
        return []

    def head_events(self, gen: Gen) -> list[Event]:
        return []

    def tail_events(self, gen: Gen) -> list[Event]:
        """Events after the last token: final chunk, usage chunk, ``b"[DONE]"`` (bytes are sent raw)."""
        raise NotImplementedError

    def full_response(self, gen: Gen) -> dict[str, Any]:
        raise NotImplementedError

    def stream_error(self, err: EngineError) -> dict[str, Any]:
        return orjson.loads(self.error_body(err))  # type: ignore[no-any-return]

    # -- shared helpers ----------------------------------------------------------------------------------------
    def send_json(self, resp: Responder, obj: Any, status: int = 200) -> None:
        resp.send(status, orjson.dumps(obj))

    def send_error(self, resp: Responder, err: EngineError) -> None:
        self.server.stats.errors += 1
        resp.send(err.status, self.error_body(err))

    def event(self, payload: bytes) -> bytes:
        le = self.line_end
        return b"data: " + payload + le + le

    def ping(self) -> bytes:
        le = self.line_end
        return b": ping" + le + le

    def done(self) -> bytes:
        return self.event(b"[DONE]")

    def events(self, evs: list[Event]) -> bytes:
        return b"".join(self.event(e if isinstance(e, bytes) else orjson.dumps(e)) for e in evs)

    def parse_json(self, req: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(req.body or b"{}")
        except orjson.JSONDecodeError as exc:
            raise EngineError(400, f"Invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise EngineError(400, "Request body must be a JSON object")
        return body

    def check_model(self, body: dict[str, Any]) -> None:
        """Default: the loaded model answers whatever ``model`` says (llama.cpp, TabbyAPI)."""


class StreamSink:
    """Scheduler sink for a streamed response: writes each token's event as it is produced."""

    __slots__ = ("done", "drop_after", "dynamic", "engine", "err_after", "gen", "head", "n_reason", "r_head",
                 "r_tail", "resp", "silent", "start", "tail")

    def __init__(self, engine: Engine, gen: Gen, resp: Responder, done: asyncio.Future[None]) -> None:
        self.engine = engine
        self.gen = gen
        self.resp = resp
        self.done = done
        le = engine.line_end
        self.dynamic = gen.kind == "native" and type(engine).dynamic_token is not Engine.dynamic_token
        chunk = engine.token_chunk(gen) if not self.dynamic else None
        self.silent = chunk is None and not self.dynamic
        h, t = template(chunk) if chunk is not None else (b"", b"")
        self.head = b"data: " + h
        self.tail = t + le + le
        self.n_reason = gen.plan.reasoning
        h, t = template(engine.reasoning_chunk(gen)) if self.n_reason else (b"", b"")
        self.r_head = b"data: " + h
        self.r_tail = t + le + le
        self.start = engine.events(engine.answer_start_events(gen)) if gen.kind == "chat" else b""
        faults = engine.server.faults
        self.drop_after = faults.drop_mid_stream_after_tokens
        self.err_after = faults.error_mid_stream_after_tokens

    def on_token(self, seq: Sequence) -> None:
        resp = self.resp
        n = seq.generated
        if self.dynamic:
            payload = self.engine.dynamic_token(self.gen, seq)
            if payload is not None:
                resp.chunk(self.engine.event(payload))
        elif n <= self.n_reason:
            resp.chunk(self.r_head + orjson.dumps(seq.output[n - 1]) + self.r_tail)
        else:
            if n == self.n_reason + 1 and self.start:
                resp.chunk(self.start)
            if not self.silent:
                resp.chunk(self.head + orjson.dumps(seq.output[n - 1]) + self.tail)
        if self.drop_after is not None and n >= self.drop_after and n < len(seq.output):
            resp.abort()
        elif self.err_after is not None and n >= self.err_after and n < len(seq.output):
            self.engine.server.scheduler.abort(seq, cancelled=False)
            err = EngineError(500, "Simulated engine failure during generation", "server")
            resp.chunk(self.engine.event(orjson.dumps(self.engine.stream_error(err))))
            if self.engine.done_after_error:
                resp.chunk(self.engine.done())
            resp.end_stream()
            if not self.done.done():
                self.done.set_result(None)

    def on_finish(self, seq: Sequence) -> None:
        self.resp.chunk(self.engine.events(self.engine.tail_events(self.gen)))
        self.resp.end_stream()
        if not self.done.done():
            self.done.set_result(None)


class CollectSink:
    """Scheduler sink for a non-streamed response: only the end matters."""

    __slots__ = ("done",)

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done

    def on_token(self, seq: Sequence) -> None:
        return None

    def on_finish(self, seq: Sequence) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def drive(engine: Engine, gen: Gen, prompt: list[int], resp: Responder,
                full: Callable[[Gen], dict[str, Any] | None] | None = None) -> None:
    """Queue one generation on the server's scheduler and answer, streamed or whole, as ``engine`` shapes it."""
    server = engine.server
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    plan = gen.plan
    sink: StreamSink | CollectSink = StreamSink(engine, gen, resp, done) if gen.stream else CollectSink(done)
    seq = Sequence(prompt, plan.pieces, plan.ids, plan.finish_reason, sink)
    seq.slot = engine.requested_slot(gen)
    seq.rank = gen.rank
    seq.salt = gen.salt
    gen.seq = seq

    def on_close() -> None:
        server.scheduler.abort(seq)
        if not done.done():
            done.set_result(None)

    resp.on_close.append(on_close)
    if gen.stream:
        resp.start_stream()
        first = engine.events(engine.head_events(gen))
        if engine.ping_at_start:
            first = engine.ping() + first
        if first:
            resp.chunk(first)
    server.scheduler.submit(seq)
    await done
    if not gen.stream and not resp.closed and seq.state == "done":
        body = (full or engine.full_response)(gen)
        resp.send(200, b"") if body is None else engine.send_json(resp, body)
