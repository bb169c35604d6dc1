"""The operator's control plane behind the admin API (``gateway.api.admin``): what each backend is doing, draining
and undraining one, the effective configuration with every secret taken out, and reloads (of the file, on
SIGHUP, the admin API or the file watch; or of the routing section alone, from the admin API).

A drain takes a backend out of routing at once (``Backend.drained``: no new request goes to it, requests
waiting in the queue go elsewhere or keep waiting); the requests it is serving finish, and it is reported
``drained`` once none is left on it. With shared state (``state.url``) a drain holds for every worker and
replica: it is published to them at once and kept in Redis, where a replica that starts later reads it.

A reload validates the whole file first (the schema, then the routing policy's plugins); an invalid one
changes nothing, and the error, naming the field at fault, is logged, counted and answered. A valid one is
applied by the composition root's ``reconfigure``, which drops no stream and no queued request.

Every change is logged (who, what) and counted (``gateway_admin_changes_total{action}``,
``gateway_config_reloads_total{result}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, Counter

from gateway.config import ConfigError, Settings, load_settings, settings_from_mapping
from gateway.errors import GatewayError
from gateway.pool.backend import Backend
from gateway.pool.pool import Pool
from gateway.proxy.admission import Admission
from gateway.routing.policies import check_settings
from gateway.state.shared import SharedState

log = logging.getLogger("gateway.admin")

REDACTED = "[redacted]"
# configuration fields whose values are secrets or lead to one (a key's hash can be brute-forced offline); a
# URL's credentials (a backend's, state.url's) are taken out wherever a URL stands
SECRET_FIELDS = frozenset({"api_key", "basic_auth", "key_sha256"})


Apply = Callable[[Settings], Awaitable[dict[str, Any]]]


class ControlPlane:
    def __init__(self, settings: Callable[[], Settings], pool: Pool, admission: Admission,
                 shared: SharedState | None, registry: CollectorRegistry, *, apply: Apply,
                 config_path: str | None = None) -> None:
        self._settings = settings  # the configuration in effect now
        self._reconfigure = apply
        self._path = config_path
        self._pool = pool
        self._admission = admission
        self._shared = shared
        self.changes = Counter("gateway_admin_changes", "Operators' changes (the admin API; reloads also by "
                               "SIGHUP or the file watch), by action.", ["action"], registry=registry)
        self.reloads = Counter("gateway_config_reloads", "Configuration reloads, by result (applied, rejected).",
                               ["result"], registry=registry)
        self._tasks: set[asyncio.Task[Any]] = set()
        if shared is not None:
            shared.on_drained(self._apply_remote)
            # a reload or routing change made through one process's admin API reaches every worker and replica
            shared.subscribe("reload", lambda who: self._spawn(self.reload(f"another replica ({who})", tell=False)))
            shared.subscribe("routing", lambda raw: self._spawn(self.set_routing(raw[0], f"another replica "
                                                                                         f"({raw[1]})", tell=False)))

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
        backend = self._pool.find(name)
        if backend is not None and backend.drained != drained:
            self._apply(backend, drained)
            log.info("admin: backend %s %s by another replica", name, "drained" if drained else "undrained")

    def _find(self, name: str) -> Backend:
        backend = self._pool.find(name)
        if backend is None:
            raise GatewayError(404, f"no backend named '{name}'", param="name", code="backend_not_found")
        return backend

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
        redacted: dict[str, Any] = redact(self._settings().model_dump(mode="json"))
        return redacted

    def _spawn(self, coro: Awaitable[Any]) -> None:
        async def run() -> None:
            with contextlib.suppress(GatewayError):  # (refused: logged and counted already)
                await coro

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self, source: str, *, tell: bool = False) -> dict[str, Any]:
        """Re-read the configuration file and apply it; ``tell``: have every other worker and replica re-read
        theirs too (the admin API; a signal or the file watch reaches each process itself). Raises
        GatewayError (400 ``invalid_config`` naming the field, 409 ``no_config_file``) and changes nothing
        when it cannot."""
        if tell and self._shared is not None:
            self._shared.publish("reload", source)
        if self._path is None:
            raise GatewayError(409, "the gateway was started without a configuration file: nothing to reload",
                               code="no_config_file")
        try:
            new = await asyncio.to_thread(load_settings, self._path)
            check_settings(new)
        except ConfigError as exc:
            self.reloads.labels("rejected").inc()
            log.error("reload (%s) rejected, the running configuration stays: %s", source, exc)
            raise GatewayError(400, f"configuration rejected, the running one stays: {exc}",
                               code="invalid_config") from None
        return await self._applied(new, source, "reload")

    async def set_routing(self, raw: Any, who: str, *, tell: bool = True) -> dict[str, Any]:
        """Replace the routing section (policy, profiles, weights): validated as a whole; lasts until the next
        reload of the file, which sets it back to the file's. ``tell``: every other worker and replica makes
        the same change."""
        current = self._settings()
        if not isinstance(raw, dict):
            raise GatewayError(400, "the body must be a JSON object: the routing section", code="invalid_config")
        merged = {**current.routing.model_dump(mode="json", exclude_defaults=True), **raw}
        try:
            routing = settings_from_mapping({"routing": merged}, "the routing section").routing
            new = current.model_copy(update={"routing": routing})
            check_settings(new)
        except ConfigError as exc:
            self.reloads.labels("rejected").inc()
            log.error("routing change by %s rejected: %s", who, exc)
            raise GatewayError(400, f"routing rejected, the running one stays: {exc}", code="invalid_config") from None
        if tell and self._shared is not None:
            self._shared.publish("routing", [raw, who])
        return await self._applied(new, who, "routing")

    async def _applied(self, new: Settings, who: str, action: str) -> dict[str, Any]:
        result = await self._reconfigure(new)
        self.reloads.labels("applied").inc()
        self.changes.labels(action).inc()
        log.info("%s by %s applied: sections %s; backends added %s, removed %s, changed %s%s", action, who,
                 ", ".join(result["sections"]) or "none", result["added"] or "none", result["removed"] or "none",
                 result["changed"] or "none",
                 f"; needs a restart: {', '.join(result['restart_needed'])}" if result["restart_needed"] else "")
        return dict(result)


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
