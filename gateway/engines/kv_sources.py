"""Reading where an engine publishes its KV-cache events (``kv_events: discover``): the address rules both
engines share. Each engine's own document is read in its module (vLLM ``GET /kv_event_sources``, SGLang
``/server_info`` ``kv_events``); an engine that shows no usable publisher is a :class:`BackendError` saying why,
and the gateway keeps the approximate prefix index for that backend.

What an engine says here is held to what a publisher of its own can be (the final sweep, as a hostile engine):
the backend's own host (a wildcard it bound becomes that host; an ``ipc://`` path only where the backend is on
this machine), a host name or address in its plain syntax, a topic of at most :data:`MAX_TOPIC` printable
characters (a 200,000-character one went into ZMQ's subscription and crashed the process when the socket was
closed), so that an engine names neither another machine (nor another backend's socket elsewhere) for the
gateway to connect to, nor a string for it to look up. An engine whose publisher lives elsewhere has its
``kv_events`` endpoint typed in the configuration."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import httpx

from gateway.config import is_loopback
from gateway.engines.base import BackendError

# what an engine binds to listen on every interface: not an address to connect to
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
MAX_TOPIC = 256  # characters of a discovered topic (vLLM's default is "", SGLang's "kv-events"-like names)
MAX_IPC_PATH = 107  # a Unix socket's path (sun_path is 108 bytes with its NUL)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_PRINTABLE = re.compile(r"[\x21-\x7e]*")


def topic_of(value: Any, what: str) -> str:
    """A discovered topic: a string of at most MAX_TOPIC printable ASCII characters ("" when none is said)."""
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > MAX_TOPIC or not _PRINTABLE.fullmatch(value):
        shown = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
        raise BackendError(f"{what}: a topic that is not at most {MAX_TOPIC} printable characters ({shown}): type "
                           "it in the configuration")
    return value


def _own_host(host: str, client: httpx.AsyncClient, what: str) -> str:
    """``host`` as the backend's own: a wildcard becomes the host of the URL the gateway reaches it at; any other
    must be that host (or, for a backend on this machine, a loopback address)."""
    backend = client.base_url.host or "127.0.0.1"
    if host in WILDCARD_HOSTS:
        return backend
    plain = host.strip("[]")
    if len(plain) > 253 or not (_HOST_NAME.fullmatch(plain) or _is_ip(plain)):
        raise BackendError(f"{what}: {host[:80]!r} is no host name or address")
    if plain.lower() == backend.strip("[]").lower() or (is_loopback(plain) and is_loopback(backend)):
        return plain
    raise BackendError(f"{what}: it publishes on {plain}, not on the backend's own host {backend}: type its kv_events "
                       "endpoint in the configuration to follow a publisher on another host")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def tcp_address(host: str, port: Any, client: httpx.AsyncClient, what: str) -> str:
    """``tcp://host:port`` to connect to: a wildcard ``host`` becomes the backend's own (the host of the URL the
    gateway reaches it at)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise BackendError(f"{what}: no usable port ({str(port)[:40]!r})")
    host = _own_host(host, client, what)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def connectable(endpoint: Any, client: httpx.AsyncClient, what: str) -> str:
    """An engine's configured ZMQ endpoint (``tcp://*:5557``, ``tcp://10.0.0.5:5557``, ``ipc:///path``) as one
    to connect to; an in-process or unparseable one is a BackendError."""
    if not isinstance(endpoint, str):
        raise BackendError(f"{what}: no endpoint ({type(endpoint).__name__})")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path.startswith("/"):  # (a relative path, or a Linux abstract socket "@name": any process's)
            raise BackendError(f"{what}: an ipc:// socket that is not an absolute path")
        if not is_loopback(client.base_url.host or "127.0.0.1"):
            raise BackendError(f"{what}: an ipc:// socket is on the engine's machine, and the backend is not on "
                               "this one")
        if not path or len(path) > MAX_IPC_PATH or not _PRINTABLE.fullmatch(path):
            raise BackendError(f"{what}: an ipc:// path that is not at most {MAX_IPC_PATH} printable characters")
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise BackendError(f"{what}: {endpoint[:80]!r} cannot be reached from another process")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not (port.isascii() and port.isdigit()) or len(port) > 5:  # (isdecimal() takes any script's digits)
        raise BackendError(f"{what}: {endpoint[:80]!r} names no port")
    return tcp_address(host, int(port), client, what)
