"""The operator's control plane behind the admin API (``gateway.api.admin``): what each backend is doing, draining
and undraining one, and the effective configuration with every secret taken out.

A drain takes a backend out of routing at once (``Backend.drained``: no new request goes to it, requests
waiting in the queue go elsewhere or keep waiting); the requests it is serving finish, and it is reported
``drained`` once none is left on it. With shared state (``state.url``) a drain holds for every worker and
replica: it is published to them at once and kept in Redis, where a replica that starts later reads it.

Every change is logged (who, what) and counted (``gateway_admin_changes_total{action}``).
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, Counter

from gateway.config import Settings
from gateway.errors import GatewayError
from gateway.pool.backend import Backend
from gateway.pool.pool import Pool
from gateway.proxy.admission import Admission
from gateway.state.shared import SharedState

log = logging.getLogger("gateway.admin")

REDACTED = "[redacted]"
# configuration fields whose values are secrets or lead to one (a key's hash can be brute-forced offline)
SECRET_FIELDS = frozenset({"api_key", "basic_auth", "key_sha256", "password", "token", "headers"})


class ControlPlane:
    def __init__(self, settings: Settings, pool: Pool, admission: Admission, shared: SharedState | None,
                 registry: CollectorRegistry) -> None:
        self._settings = settings
        self._pool = pool
        self._admission = admission
        self._shared = shared
        self.changes = Counter("gateway_admin_changes", "Changes made through the admin API, by action.",
                               ["action"], registry=registry)
        if shared is not None:
            shared.on_drained(self._apply_remote)

    # -- backends -------------------------------------------------------------------------------------------
    def backends(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [self._describe(b, now) for b in self._pool]

    def backend(self, name: str) -> dict[str, Any]:
        return self._describe(self._find(name), time.monotonic())

    def drain(self, name: str, who: str) -> dict[str, Any]:
        return self._set(name, True, who)

    def undrain(self, name: str, who: str) -> dict[str, Any]:
        return self._set(name, False, who)

    def _set(self, name: str, drained: bool, who: str) -> dict[str, Any]:
        backend = self._find(name)
        action = "drain" if drained else "undrain"
        changed = backend.drained != drained
        self._apply(backend, drained)
        if self._shared is not None:
            self._shared.set_drained(name, drained)
        self.changes.labels(action).inc()
        log.info("admin: %s %s backend %s%s", who, "drained" if drained else "undrained", name,
                 "" if changed else " (it already was)")
        return self._describe(backend, time.monotonic())

    def _apply(self, backend: Backend, drained: bool) -> None:
        backend.drained = drained
        if not drained:  # (requests waiting for a slot may take one of its at once)
            self._admission.freed([backend])

    def _apply_remote(self, name: str, drained: bool) -> None:
        backend = next((b for b in self._pool if b.name == name), None)
        if backend is not None and backend.drained != drained:
            self._apply(backend, drained)
            log.info("admin: backend %s %s by another replica", name, "drained" if drained else "undrained")

    def _find(self, name: str) -> Backend:
        for backend in self._pool:
            if backend.name == name:
                return backend
        raise GatewayError(404, f"no backend named '{name}'", param="name", code="backend_not_found")

    def _describe(self, b: Backend, now: float) -> dict[str, Any]:
        elsewhere = self._shared.remote_in_flight(b.name) if self._shared is not None and b.max_concurrency else 0
        if b.drained:
            state = "draining" if b.in_flight or elsewhere else "drained"
        else:
            state = "serving" if b.routable else "unavailable"
        load = b.load
        return {
            "name": b.name, "engine": b.engine, "url": redact_url(b.url), "models": sorted(b.models),
            "state": state, "drained": b.drained, "health": b.health.value, "detail": b.detail,
            "breaker": b.breaker.state.value, "routable": b.routable,
            "in_flight": b.in_flight, "in_flight_elsewhere": elsewhere,
            "max_concurrency": b.max_concurrency, "slots": b.slots,
            "context_length": b.capacity.context_length,
            "load": None if load is None else {
                "running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage,
                "age_seconds": round(now - load.read_at, 3), "fresh": b.fresh_load(now) is not None},
            "scrape_errors": b.scrape_errors, "epoch": b.epoch,
        }

    # -- configuration --------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The effective settings (after the file, the environment and defaults), every secret redacted."""
        redacted: dict[str, Any] = redact(self._settings.model_dump(mode="json"))
        return redacted


def redact(value: Any, field: str = "") -> Any:
    if field in SECRET_FIELDS and value not in (None, "", [], {}):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str) and "://" in value:
        return redact_url(value)
    return value


def redact_url(url: str) -> str:
    """The URL without its user and password (``redis://:secret@host`` -> ``redis://[redacted]@host``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{REDACTED}@{host}"))
