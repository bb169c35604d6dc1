"""Reading where an engine publishes its KV-cache events (``kv_events: discover``): the address rules both
engines share. Each engine's own document is read in its module (vLLM ``GET /kv_event_sources``, SGLang
``/server_info`` ``kv_events``); an engine that shows no usable publisher is a :class:`BackendError` saying why,
and the gateway keeps the approximate prefix index for that backend."""

from __future__ import annotations

from typing import Any

import httpx

from gateway.engines.base import BackendError

# what an engine binds to listen on every interface: not an address to connect to
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def tcp_address(host: str, port: Any, client: httpx.AsyncClient, what: str) -> str:
    """``tcp://host:port`` to connect to: a wildcard ``host`` becomes the backend's own (the host of the URL the
    gateway reaches it at)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise BackendError(f"{what}: no usable port ({port!r})")
    if host in WILDCARD_HOSTS:
        host = client.base_url.host or "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def connectable(endpoint: Any, client: httpx.AsyncClient, what: str) -> str:
    """An engine's configured ZMQ endpoint (``tcp://*:5557``, ``tcp://10.0.0.5:5557``, ``ipc:///path``) as one
    to connect to; an in-process or unparseable one is a BackendError."""
    if not isinstance(endpoint, str):
        raise BackendError(f"{what}: no endpoint ({endpoint!r})")
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise BackendError(f"{what}: {endpoint!r} cannot be reached from another process")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdecimal():
        raise BackendError(f"{what}: {endpoint!r} names no port")
    return tcp_address(host, int(port), client, what)
