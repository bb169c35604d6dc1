"""The server's limits resolved from settings, and the one uvicorn configuration that carries them (used by
``gateway serve`` and by every test or benchmark that runs the gateway in a thread).

Client connections and upstream connections share the process's descriptor limit. The default connection
cap keeps a reserve for the upstream side (proxied requests, health checks and scrapes, logs, the event
loop's own descriptors): a quarter of the limit, at least 1024, but never more than half of it. With the
usual hard limit of 1,048,576 that lets 786,432 clients in; with the 20,000 that ran out in issue 13 it
lets 15,000 in and keeps 5,000 for the backends; with a bare 1,024 it splits it in two.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from typing import Any

import uvicorn

from gateway.config import ServerSettings
from gateway.server_protocol import ServerLimits, StampedHttpToolsProtocol


def raise_nofile_limit() -> int:
    """Raise the soft descriptor limit to the hard one (the soft default, often 1024, is far below what a
    gateway holding thousands of streams needs); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # a platform that refuses keeps the limit it had
    return soft


def default_max_connections(nofile: int) -> int:
    reserve = min(max(1024, nofile // 4), nofile // 2)
    return max(1, nofile - reserve)


def limits_for(server: ServerSettings, on_refusal: Callable[[str], None] | None = None) -> ServerLimits:
    cap = server.max_connections
    if cap is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        cap = default_max_connections(soft if soft != resource.RLIM_INFINITY else 1 << 20)
    return ServerLimits(max_header_bytes=server.max_header_bytes, header_timeout=server.header_timeout,
                        body_timeout=server.body_timeout, max_connections=cap, on_refusal=on_refusal)


def _refusal_counter(app: Any) -> Callable[[str], None] | None:
    """The gateway app's ``gateway_connections_refused_total``, as a callback (None for other apps)."""
    metrics = getattr(getattr(app, "gateway", None), "metrics", None)
    if metrics is None:
        return None
    children: dict[str, Any] = {}

    def refused(code: str) -> None:
        child = children.get(code)
        if child is None:
            child = children[code] = metrics.connections_refused.labels(code)
        child.inc()

    return refused


class LimitedConfig(uvicorn.Config):
    """uvicorn's configuration plus the limits :class:`StampedHttpToolsProtocol` reads from it."""

    def __init__(self, app: Any, limits: ServerLimits, **options: Any) -> None:
        super().__init__(app, **options)
        self.limits = limits


def uvicorn_config(app: Any, server: ServerSettings, *, log_level: str = "info",
                   graceful_shutdown: float | None = None, lifespan: str = "on") -> LimitedConfig:
    """uvloop + httptools with the gateway's protocol and limits, on ``server.host:server.port`` (ignored when
    the caller hands ``uvicorn.Server.serve`` its own sockets). The connection cap is resolved against the
    descriptor limit in force now: call :func:`raise_nofile_limit` first where that should count."""
    grace = server.shutdown_timeout if graceful_shutdown is None else graceful_shutdown
    return LimitedConfig(
        app,
        limits_for(server, _refusal_counter(app)),
        host=server.host,
        port=server.port,
        loop="uvloop",
        http=StampedHttpToolsProtocol,
        # no route speaks WebSocket: an upgrade is refused in the OpenAI shape like any other (server_protocol),
        # where uvicorn's WebSocket path answered a bare 403
        ws="none",
        lifespan=lifespan,
        access_log=False,
        # Nothing of the gateway reads the client's address, so rewriting it from X-Forwarded-For (uvicorn's
        # default middleware, run for every request) serves nothing; nor does announcing "server: uvicorn".
        proxy_headers=False,
        server_header=False,
        log_level=log_level,
        # uvicorn annotates it int, but only ever hands it to loop.call_later
        timeout_keep_alive=server.keepalive_timeout,
        timeout_graceful_shutdown=math.ceil(grace),
    )
