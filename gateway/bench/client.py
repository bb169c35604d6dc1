"""Send one streamed request and measure it at the client: aiohttp (never httpx, whose pool is the
bottleneck under concurrency; ../shared/PERFORMANCE.md), one session per target.

Per request: time to first token (first event carrying content), gaps between content events, end-to-end
time, output and prompt tokens from the usage event (always requested with ``stream_options.include_usage``),
cached prompt tokens when reported (``usage.prompt_tokens_details.cached_tokens``) and the backend that
served it (``x-gateway-backend``, present only behind the gateway).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from gateway.bench.workload import BenchRequest


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint. ``url`` with or without ``/v1``; ``model`` None: the first one listed.
    ``replicas``: several equivalent endpoints (gateway replicas) that requests take in turn, as behind a
    round-robin load balancer; ``url`` is then the first of them."""

    name: str
    url: str
    model: str | None = None
    api_key: str | None = None
    pid: int | None = None  # a local server process whose CPU time is sampled per phase, when known
    # the API its requests speak: "chat" (/v1/chat/completions) or "messages" (Anthropic's /v1/messages, the
    # chat request's messages and max_tokens in Anthropic's shape)
    api: str = "chat"
    replicas: tuple[str, ...] = ()
    # several API keys (tenants of a gateway with keys): request i is sent with key i mod their number
    tenant_keys: tuple[str, ...] = ()
    _turn: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    def key_for(self, req: BenchRequest) -> str | None:
        """The API key ``req`` is sent with."""
        if self.tenant_keys:
            return self.tenant_keys[req.index % len(self.tenant_keys)]
        return self.api_key

    @property
    def base(self) -> str:
        url = self.url
        if self.replicas:
            url = self.replicas[self._turn[0] % len(self.replicas)]
            self._turn[0] += 1
        url = url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url


def parse_target(spec: str) -> Target:
    """``NAME=URL`` (or a bare URL, named by its host:port)."""
    name, sep, url = spec.partition("=")
    if not sep:
        url = spec
        name = spec.split("://", 1)[-1].split("/", 1)[0]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"target {spec!r}: the URL must start with http:// or https://")
    return Target(name=name.strip(), url=url.strip())


@dataclass
class RequestResult:
    index: int
    target: str
    round: int = 0
    start: float = 0.0  # seconds since the run began
    ok: bool = False
    status: int = 0
    error: str | None = None
    ttfb: float = math.nan  # response headers received
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # content events received
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    backend: str | None = None
    structured: bool = False

    @property
    def decode_tok_s(self) -> float:
        """This request's own decode speed: tokens after the first over the time after the first."""
        if self.output_tokens < 2 or math.isnan(self.ttft) or self.e2e <= self.ttft:
            return math.nan
        return (self.output_tokens - 1) / (self.e2e - self.ttft)

    def to_json(self) -> dict[str, Any]:
        def num(v: float) -> float | None:
            return round(v, 6) if math.isfinite(v) else None

        return {"index": self.index, "round": self.round, "start": num(self.start), "ok": self.ok,
                "status": self.status, "error": self.error, "ttfb": num(self.ttfb),
                "ttft": num(self.ttft), "e2e": num(self.e2e),
                "chunks": self.chunks, "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "backend": self.backend, "structured": self.structured,
                "itl_mean": num(sum(self.itl) / len(self.itl)) if self.itl else None}


def has_content(doc: Any) -> bool:
    """Whether a streamed chunk carries generated output (text, content, reasoning or tool calls)."""
    if not isinstance(doc, dict):
        return False
    choices = doc.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")
                                        or delta.get("reasoning") or delta.get("tool_calls")):
            return True
    return False


class SSEEvents:
    """Split a byte stream into the ``data:`` payloads of server-sent events (``\\n\\n`` or ``\\r\\n\\r\\n``)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return []
        block, self._buf = buf[:end], buf[end + 2 :]
        out = []
        for event in block.split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].strip())
        return out


def request_body(req: BenchRequest, model: str, stream: bool = True, api: str = "chat") -> bytes:
    body = {**req.body, "model": model, "stream": stream}
    if api == "messages":  # (a system message becomes Anthropic's top-level system)
        system = [m["content"] for m in body["messages"] if m.get("role") == "system"]
        body["messages"] = [m for m in body["messages"] if m.get("role") != "system"]
        if system:
            body["system"] = "\n".join(system)
        body.setdefault("max_tokens", 256)
        return orjson.dumps(body)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def anthropic_event(result: RequestResult, doc: Any) -> bool:
    """Note what an Anthropic Messages stream event says (usage, an error); whether it carries generated output
    (a text, thinking or tool-input delta)."""
    if not isinstance(doc, dict):
        return False
    kind = doc.get("type")
    if kind == "content_block_delta":
        delta = doc.get("delta")
        return isinstance(delta, dict) and bool(delta.get("text") or delta.get("thinking")
                                                or delta.get("partial_json"))
    if kind == "message_start":
        message = doc.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
            result.prompt_tokens = usage["input_tokens"]
    elif kind == "message_delta":
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
            result.output_tokens = usage["output_tokens"]
    elif kind == "error":
        err = doc.get("error")
        result.error = str(err.get("message") if isinstance(err, dict) else err)
    return False


def apply_usage(result: RequestResult, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("completion_tokens"), int):
        result.output_tokens = usage["completion_tokens"]
    if isinstance(usage.get("prompt_tokens"), int):
        result.prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]


async def send_streaming(session: aiohttp.ClientSession, target: Target, model: str, req: BenchRequest,
                         result: RequestResult, request_timeout: float = 600.0) -> RequestResult:
    """Send ``req`` to ``target`` streamed and fill ``result``; never raises for HTTP or network failures."""
    headers = {"Content-Type": "application/json"}
    key = target.key_for(req)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    messages = target.api == "messages"
    payload = request_body(req, model, api=target.api)
    result.structured = req.structured
    t0 = time.perf_counter()
    last = t0
    usage_seen = False
    try:
        async with session.post(target.base + ("/v1/messages" if messages else "/v1/chat/completions"),
                                data=payload, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=request_timeout)) as resp:
            result.ttfb = time.perf_counter() - t0
            result.status = resp.status
            result.backend = resp.headers.get("x-gateway-backend")
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                result.error = f"HTTP {resp.status}: {text}"
                result.e2e = time.perf_counter() - t0
                return result
            events = SSEEvents()
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                for payload_ in events.feed(data):
                    if payload_ == b"[DONE]":
                        continue
                    try:
                        doc = orjson.loads(payload_)
                    except orjson.JSONDecodeError:
                        continue
                    if messages:
                        content = anthropic_event(result, doc)
                        usage_seen = usage_seen or (isinstance(doc, dict) and doc.get("type") == "message_delta")
                    else:
                        if isinstance(doc, dict) and "error" in doc and not doc.get("choices"):
                            err = doc["error"]
                            result.error = str(err.get("message") if isinstance(err, dict) else err)
                        content = has_content(doc)
                        if isinstance(doc, dict) and isinstance(doc.get("usage"), dict):
                            usage_seen = True
                            apply_usage(result, doc["usage"])
                    if content:
                        if result.chunks == 0:
                            result.ttft = now - t0
                        else:
                            result.itl.append(now - last)
                        last = now
                        result.chunks += 1
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e = time.perf_counter() - t0
    if not usage_seen:
        result.output_tokens = result.chunks
    result.ok = result.error is None and result.status == 200 and result.chunks > 0
    if result.ok is False and result.error is None:
        result.error = "the stream carried no content"
    return result


def new_session(limit: int = 0) -> aiohttp.ClientSession:
    """One keep-alive pool without a connection limit (the benchmark sets concurrency, not the pool)."""
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=4, force_close=False)
    return aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                 skip_auto_headers=("User-Agent", "Accept-Encoding"),
                                 timeout=aiohttp.ClientTimeout(total=None))


async def resolve_model(session: aiohttp.ClientSession, target: Target) -> str:
    """``target.model`` or the first model the endpoint lists."""
    if target.model:
        return target.model
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    try:
        async with session.get(target.base + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            doc = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError, OSError, orjson.JSONDecodeError) as exc:
        raise RuntimeError(f"{target.name}: cannot list models at {target.base}/v1/models ({exc})") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not data:
        raise RuntimeError(f"{target.name}: {target.base}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
