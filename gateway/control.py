"""The operator's control plane behind the admin API (``gateway.api.admin``): what each backend is doing, draining
and undraining one, the effective configuration with every secret taken out, and reloads (of the file, on
SIGHUP, the admin API or the file watch; or of the routing section alone, from the admin API).

A drain takes a backend out of routing at once (``Backend.drained``: no new request goes to it, requests
waiting in the queue go elsewhere or keep waiting); the requests it is serving finish, and it is reported
``drained`` once none is left on it. With shared state (``state.url``) a drain holds for every worker and
replica: it is published to them at once and kept in Redis, where a replica that starts later reads it.

A reload reads the file once and validates those bytes as a whole (the schema, the routing policy's plugins,
and :func:`gateway.config_reload.check_reload`: no key or backend taken away by a file cut short); an invalid
one changes nothing, and the error, naming the field at fault, is logged, counted and answered. A valid one is
applied by the composition root's ``reconfigure``, which drops no stream and no queued request. The file watch
reloads a changed file only once it has held still (:func:`gateway.config_reload.stable_contents`).

Every change is logged (who, what) and counted (``gateway_admin_changes_total{action}``,
``gateway_config_reloads_total{result}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, NoReturn

import orjson
from prometheus_client import CollectorRegistry, Counter

from gateway.clock import SYSTEM, Clock
from gateway.config import (
    ApiKeySettings,
    ConfigError,
    Settings,
    parse_settings,
    read_settings_file,
    settings_from_mapping,
)
from gateway.config_reload import KnownKeys, check_reload, stable_contents
from gateway.errors import GatewayError
from gateway.pool.backend import Backend
from gateway.pool.pool import Pool
from gateway.proxy.admission import Admission
from gateway.proxy.models import ModelMap
from gateway.redaction import REDACTED, redact_url
from gateway.routing.policies import check_settings
from gateway.state.shared import SharedState
from gateway.tasks import cancel_and_wait
from gateway.telemetry.recent import Recent, empty, merge, series, summary
from gateway.workers import InForce, Siblings

log = logging.getLogger("gateway.admin")

# configuration fields whose values are secrets or lead to one (a key's hash can be brute-forced offline); a
# URL's credentials (a backend's, state.url's) are taken out wherever a URL stands
SECRET_FIELDS = frozenset({"api_key", "basic_auth", "key_sha256"})
# the routing fields that name files on the gateway's machine: read at start only, never set through the API
STARTUP_ROUTING = ("tokenizers", "engine_profile", "tokenize_max_chars")


def environment_fields(raw: Any) -> list[str]:
    """The fields of ``raw`` (at any depth) that name an environment variable (``api_key_env``, any ``*_env``)."""
    if isinstance(raw, dict):
        own = [k for k in raw if isinstance(k, str) and k.endswith("_env")]
        return own + [f for v in raw.values() for f in environment_fields(v)]
    if isinstance(raw, list):
        return [f for v in raw for f in environment_fields(v)]
    return []


Apply = Callable[[Settings], Awaitable[dict[str, Any]]]


class ControlPlane:
    def __init__(self, settings: Callable[[], Settings], pool: Pool, admission: Admission,
                 shared: SharedState | None, registry: CollectorRegistry, *, apply: Apply,
                 config_path: str | None = None, recent: Recent | None = None,
                 models: Callable[[], ModelMap] | None = None, siblings: Siblings | None = None,
                 config_content: bytes | None = None, on_applied: Callable[[InForce], None] | None = None,
                 known: Sequence[ApiKeySettings] = (), clock: Clock = SYSTEM) -> None:
        self._clock = clock  # (the pool's: its readings' ages are told on it)
        self._settings = settings  # the configuration in effect now
        self._reconfigure = apply
        self._path = config_path
        self._content = config_content  # the file's bytes the configuration in effect was read from
        self._read_at = 0.0  # when they were read (clock.monotonic(); 0: before this process)
        # one change at a time, in the order asked: a reload reads the file when its turn comes, and every change
        # is worked out from the configuration in force when it is applied (a slow reload started first landed
        # after a newer one and brought a revoked key back)
        self._changing = asyncio.Lock()
        self._reload_waiting = False  # a SIGHUP's reload waits for its turn (more SIGHUPs meanwhile: that one)
        self._reload_at_start: str | None = None  # a SIGHUP came before start(): a reload once started
        # every key in force since the start: one a change removed and a reload brings back is held to what it had
        self._known = KnownKeys(known)  # (what the other workers had in force: see InForce.known)
        self._known.saw(settings().auth.keys)
        self._on_applied = on_applied  # told what is in force after each change (a worker's supervisor)
        self._reporting = asyncio.Lock()  # (one report at a time, so that the last one told is the latest)
        self._pool = pool
        self._admission = admission
        self._shared = shared
        self.recent = recent if recent is not None else Recent()
        self._models = models
        self._siblings = siblings
        if siblings is not None:  # (the status page asks every worker for its part)
            siblings.answer(b"recent", lambda: orjson.dumps(self.recent.raw(time.perf_counter())))
        self.changes = Counter("gateway_admin_changes", "Operators' changes (the admin API; reloads also by "
                               "SIGHUP or the file watch), by action.", ["action"], registry=registry)
        self.reloads = Counter("gateway_config_reloads", "Configuration reloads, by result (applied, rejected, "
                               "failed: an error of the gateway's own while applying).",
                               ["result"], registry=registry)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: str | None = None  # why no change is taken any more (the gateway is stopping)
        if shared is not None:
            shared.on_drained(self._apply_remote)
            # a reload or routing change made through one process's admin API reaches every worker and replica
            shared.subscribe("reload", lambda who: self._spawn(self.reload(f"another replica ({who})", tell=False)))
            shared.subscribe("routing", lambda raw: self._spawn(self.set_routing(raw[0], f"another replica "
                                                                                         f"({raw[1]})", tell=False)))
            shared.subscribe("backends", lambda raw: self._spawn(self._remote_backends(raw)))

    # -- running --------------------------------------------------------------------------------------------
    async def start(self, *, watch_seconds: float | None = None, settle_seconds: float = 2.0) -> None:
        """The recent view's sampler, and the file watch (``server.reload_watch_seconds``, a change applied once
        it held still ``settle_seconds``) when asked for."""
        self._loop = asyncio.get_running_loop()
        self._spawn(self._sample_forever())
        if self._reload_at_start is not None:
            self._reload_once_more(self._reload_at_start)
        if watch_seconds and self._path is not None:
            self._spawn(self._watch_config(watch_seconds, settle_seconds))

    def close(self, why: str) -> None:
        """The gateway is stopping (``why``: the signal): from now on every change is refused with a 503 and
        reload requests are ignored; what reads the state still answers, to watch the streams finish."""
        if self._closing is None:
            self._closing = why
            log.info("control plane: no more changes (%s: shutting down)", why)

    def _open_for_changes(self) -> None:
        if self._closing is not None:
            raise GatewayError(503, f"the gateway is shutting down ({self._closing}): no change is applied",
                               code="shutting_down")

    async def stop(self) -> None:
        self.close("stopped")
        await cancel_and_wait(list(self._tasks))

    async def _sample_forever(self) -> None:
        recent, pool, admission = self.recent, self._pool, self._admission
        while True:
            names = {b.name: b.in_flight for b in pool}
            for gone in recent.backends() - names.keys():
                recent.forget(gone)
            recent.sample(time.perf_counter(), names, sum(admission.depth().values()))
            await self._clock.sleep(recent.step / 2)

    def request_reload(self, source: str) -> None:
        """Re-read the configuration file (SIGHUP): safe to call from a signal handler on the loop's thread or
        from another thread."""
        loop = self._loop
        if loop is None and self._path is not None and self._closing is None:
            log.info("reload (%s): once the gateway has started", source)  # (the file may have changed meanwhile)
            self._reload_at_start = source
            return
        if loop is None or self._path is None or self._closing is not None:
            log.warning("reload (%s) ignored: %s", source, "the gateway runs without a configuration file"
                        if self._path is None else f"shutting down ({self._closing})")
            return
        loop.call_soon_threadsafe(self._reload_once_more, source)

    def _reload_once_more(self, source: str) -> None:
        if not self._reload_waiting:  # (one waiting reads the file after whatever runs now: enough for any number)
            self._reload_waiting = True
            self._spawn(self._reload_in_turn(source))

    async def _reload_in_turn(self, source: str) -> None:
        turn = False
        try:
            self._open_for_changes()
            async with self._changing:
                turn = True
                self._reload_waiting = False  # (a signal from now on reads the file after this reading)
                await self._reload_now(source, None, None)
        finally:
            if not turn:
                self._reload_waiting = False

    async def _watch_config(self, every: float, settle: float) -> None:
        """Read the file every ``every`` seconds; a changed content that then stays the same for ``settle`` seconds
        is reloaded, exactly as read (an invalid one is refused, logged and counted like any reload, and not
        retried until the file changes again)."""
        assert self._path is not None
        path = self._path

        read_at = 0.0

        def read() -> bytes | None:
            try:  # (bounded, and never waiting on a FIFO put in the file's place: one would stop the watch)
                return read_settings_file(path)
            except ConfigError:
                return None

        async def fingerprint() -> bytes | None:
            nonlocal read_at
            read_at = self._clock.monotonic()  # (just before the read: a later read is a later reading)
            return await asyncio.to_thread(read)

        async for content in stable_contents(fingerprint, every, settle, sleep=self._clock.sleep,
                                             in_force=self._content):
            try:
                await self.reload("file watch", content=content, read_at=read_at)
            except GatewayError:  # (refused: logged and counted already)
                pass
            except Exception:  # a reload that failed in the gateway's own code must not end the watch: the next
                # change to the file (a key revoked) would be ignored until a restart
                self.reloads.labels("failed").inc()
                log.exception("reload (file watch) failed; the watch goes on")

    # -- backends -------------------------------------------------------------------------------------------
    async def backends(self) -> list[dict[str, Any]]:
        view = await self._recent_view()
        now = self._clock.monotonic()
        return [self._describe(b, now, view) for b in self._pool]

    async def backend(self, name: str) -> dict[str, Any]:
        backend = self._find(name)
        return self._describe(backend, self._clock.monotonic(), await self._recent_view())

    async def status(self) -> dict[str, Any]:
        """The status page's one reading: every backend as ``GET /admin/backends`` describes it plus its
        sparklines (``series``: per bucket of ``step_seconds``, oldest first), the admission queue, the models
        (served ones with their backends; aliases with their splits and fallbacks) and the decisions by reason."""
        view = await self._recent_view()
        now = self._clock.monotonic()
        backends = []
        decisions: dict[str, int] = {}
        for b in self._pool:
            entry = self._describe(b, now, view)
            entry["series"] = series(view["backends"].get(b.name) or empty(len(view["queued"])), view["step"])
            for reason, n in entry["recent"]["decisions"].items():
                decisions[reason] = decisions.get(reason, 0) + n
            backends.append(entry)
        served: dict[str, list[str]] = {}
        for b in self._pool:
            for model in sorted(b.models):
                served.setdefault(model, []).append(b.name)
        return {
            "time": self._clock.time(), "step_seconds": view["step"], "window_seconds": view["window"] * view["step"],
            "workers": view["workers"], "backends": backends,
            # (this process's queue now; with several workers, the most any held in this bucket, added up)
            "queue": {"queued": sum(self._admission.depth().values()) if view["workers"] == 1
                      else int(view["queued"][-1]), "series": [int(v) for v in view["queued"]]},
            "decisions": dict(sorted(decisions.items(), key=lambda kv: -kv[1])),
            "models": {"served": served, "aliases": self._models().describe() if self._models is not None else {}},
        }

    async def _recent_view(self) -> dict[str, Any]:
        """The recent view of every worker that answers in time, added up."""
        views = [self.recent.raw(time.perf_counter())]
        if self._siblings is not None:
            views += [orjson.loads(a) for a in await self._siblings.ask_others(b"recent") if a is not None]
        merged = merge(views)
        merged["workers"] = len(views)
        return merged

    def drain(self, name: str, who: str) -> dict[str, Any]:
        return self._set(name, True, who)

    def undrain(self, name: str, who: str) -> dict[str, Any]:
        return self._set(name, False, who)

    def _set(self, name: str, drained: bool, who: str) -> dict[str, Any]:
        self._open_for_changes()
        backend = self._find(name)
        action = "drain" if drained else "undrain"
        changed = backend.drained != drained
        self._apply(backend, drained)
        if self._shared is not None:
            self._shared.set_drained(name, drained)
        self.changes.labels(action).inc()
        log.info("admin: %s %s backend %s%s", who, "drained" if drained else "undrained", name,
                 "" if changed else " (it already was)")
        return self._describe(backend, self._clock.monotonic(), None)

    async def add_backend(self, raw: Any, who: str, *, tell: bool = True) -> dict[str, Any]:
        """Add a backend (a ``backends:`` entry, as in the file): validated with the whole configuration, probed
        before it is routed to. It lasts until the next reload of the file (which holds the lasting list).
        ``tell``: every other worker and replica adds it too."""
        self._open_for_changes()
        if not isinstance(raw, dict):
            raise GatewayError(400, "the body must be a JSON object: one backends entry", code="invalid_config")
        if raw.get("dns") is not None:
            raise GatewayError(400, "a DNS entry (dns:) is read at start only: add it to the file and restart",
                               param="dns", code="invalid_config")
        named = environment_fields(raw)
        if named:  # (api_key_env: AWS_SECRET_ACCESS_KEY sent that variable's value to a URL of the caller's)
            self._refused(who, "backend", f"{named[0]} names an environment variable of the gateway: a backend added "
                          "at runtime may not read the gateway's environment; send api_key, or add the backend to "
                          "the file and reload", param=named[0])
        async with self._changing:
            current = self._settings()
            name = raw.get("name")
            if isinstance(name, str) and self._pool.find(name) is not None:
                raise GatewayError(409, f"a backend named '{name}' exists: remove it first, or change it in the "
                                   "file and reload", param="name", code="backend_exists")
            fields = {field: getattr(current, field) for field in type(current).model_fields}
            fields["backends"] = [*current.backends, raw]
            new = self._validated(lambda: settings_from_mapping(fields, "the new backend"), who, "backend")
            if tell and self._shared is not None:
                self._shared.publish("backends", ["add", raw, who])
            result = await self._applied(new, who, "add_backend")
        added = new.backends[-1].name
        backend = self._pool.find(added)
        described = None if backend is None else self._describe(backend, self._clock.monotonic(), None)
        return {**result, "backend": described}

    async def remove_backend(self, name: str, who: str, *, tell: bool = True) -> dict[str, Any]:
        """Remove a backend: drained first (no new request; those in flight finish, the shutdown timeout at
        most), then dropped. Answers at once, with the backend ``removing`` until it is gone. Lasts until the
        next reload of the file. ``tell``: every other worker and replica removes it too."""
        self._open_for_changes()
        async with self._changing:
            backend = self._find(name)
            if self._pool.discovered(name):
                raise GatewayError(400, f"backend '{name}' is a replica found by DNS: drain it, or change its DNS "
                                   "entry in the file and restart", param="name", code="invalid_config")
            current = self._settings()
            new = current.model_copy(update={"backends": [b for b in current.backends if b.name != name]})
            if tell and self._shared is not None:
                self._shared.publish("backends", ["remove", name, who])
            result = await self._applied(new, who, "remove_backend")
        return {**result, "backend": self._describe(backend, self._clock.monotonic(), None)}

    async def _remote_backends(self, raw: Any) -> None:
        action, what, who = raw
        source = f"another replica ({who})"
        if action == "add" and isinstance(what, dict) and self._pool.find(str(what.get("name"))) is None:
            await self.add_backend(what, source, tell=False)
        elif action == "remove" and self._pool.find(str(what)) is not None and not self._pool.leaving(str(what)):
            await self.remove_backend(str(what), source, tell=False)

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

    def _describe(self, b: Backend, now: float, view: dict[str, Any] | None) -> dict[str, Any]:
        elsewhere = self._shared.remote_in_flight(b.name) if self._shared is not None and b.max_concurrency else 0
        if self._pool.leaving(b.name):
            state = "removing"
        elif b.drained:
            state = "draining" if b.in_flight or elsewhere else "drained"
        else:
            state = "serving" if b.routable else "unavailable"
        load = b.load
        return {
            "name": b.name, "engine": b.engine, "url": redact_url(b.url), "models": sorted(b.models),
            "state": state, "drained": b.drained, "health": b.health.value, "detail": b.detail,
            "breaker": b.breaker.state.value, "routable": b.routable,
            "in_flight": b.in_flight, "in_flight_elsewhere": elsewhere,
            "slots_kept": self._shared.kept(b.name) if self._shared is not None else 0,
            "max_concurrency": b.max_concurrency, "slots": b.slots,
            "context_length": b.capacity.context_length,
            "load": None if load is None else {
                "running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage,
                "age_seconds": round(now - load.read_at, 3), "fresh": b.fresh_load(now) is not None},
            "scrape_errors": b.scrape_errors, "epoch": b.epoch,
            **({} if view is None else
               {"recent": summary(view["backends"].get(b.name) or empty(len(view["queued"])), view["step"],
                                  view["window"])}),
        }

    # -- configuration --------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The effective settings (after the file, the environment and defaults), every secret redacted."""
        redacted: dict[str, Any] = redact(self._settings().model_dump(mode="json"))
        return redacted

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and not isinstance(error, GatewayError):  # (a refusal is logged and counted already)
            log.error("control plane task %s failed", task.get_name(), exc_info=error)

    async def reload(self, source: str, *, tell: bool = False, content: bytes | None = None,
                     read_at: float | None = None) -> dict[str, Any]:
        """Re-read the configuration file and apply it, once every change asked before it is done (the file is
        read when its turn comes); ``content``: the file's bytes as the watch read them at ``read_at``
        (the clock's monotonic time), not read again, and not applied over a later reading already in force; ``tell``:
        have every other worker and replica re-read theirs too (the admin API; a signal or the file watch reaches
        each process itself). Raises GatewayError (400 ``invalid_config`` naming the field, 409
        ``no_config_file``) and changes nothing when it cannot: an invalid file, an empty one, or one that would
        take away every key or every backend without saying so."""
        self._open_for_changes()
        if tell and self._shared is not None:
            self._shared.publish("reload", source)
        if self._path is None:
            raise GatewayError(409, "the gateway was started without a configuration file: nothing to reload",
                               code="no_config_file")
        async with self._changing:
            return await self._reload_now(source, content, read_at, tell=tell)

    async def _reload_now(self, source: str, content: bytes | None, read_at: float | None, *,
                          tell: bool = False) -> dict[str, Any]:
        """The reload's work, its turn come (``self._changing`` held)."""
        assert self._path is not None
        self._open_for_changes()  # (the gateway may have begun stopping while this waited)
        if content is None or read_at is None:
            read_at = self._clock.monotonic()
        elif read_at < self._read_at:
            log.info("reload (%s) skipped: the file as read later is in force", source)
            return {"added": [], "removed": [], "changed": [], "sections": [], "restart_needed": []}
        try:
            if content is None:
                content = await asyncio.to_thread(read_settings_file, self._path)
            new = await asyncio.to_thread(parse_settings, content, self._path)
            check_reload(self._settings(), new, self._known)
            check_settings(new)
        except ConfigError as exc:
            self.reloads.labels("rejected").inc()
            log.error("reload (%s) rejected, the running configuration stays: %s", source, exc)
            raise GatewayError(400, f"configuration rejected, the running one stays: {exc}",
                               code="invalid_config") from None
        result = await self._applied(new, source, "reload", content, tell=tell)
        self._read_at = read_at
        return result

    async def set_routing(self, raw: Any, who: str, *, tell: bool = True) -> dict[str, Any]:
        """Replace the routing section (policy, profiles, weights): validated as a whole; lasts until the next
        reload of the file, which sets it back to the file's. ``tell``: every other worker and replica makes
        the same change."""
        self._open_for_changes()
        if not isinstance(raw, dict):
            raise GatewayError(400, "the body must be a JSON object: the routing section", code="invalid_config")
        async with self._changing:
            current = self._settings()
            running = current.routing.model_dump(mode="json")
            for field in STARTUP_ROUTING:
                if field in raw and raw[field] != running[field]:  # (paths on the gateway's machine, read at start)
                    self._refused(who, "routing", f"routing.{field} names files on the gateway's machine and is read "
                                  "at start only: set it in the file and restart", param=field)
            merged = {**current.routing.model_dump(mode="json", exclude_defaults=True), **raw}

            def build() -> Settings:
                routing = settings_from_mapping({"routing": merged}, "the routing section").routing
                return current.model_copy(update={"routing": routing})

            new = self._validated(build, who, "routing")
            if tell and self._shared is not None:
                self._shared.publish("routing", [raw, who])
            return await self._applied(new, who, "routing")

    def _refused(self, who: str, what: str, why: str, *, param: str) -> NoReturn:
        self.reloads.labels("rejected").inc()
        log.error("%s change by %s rejected: %s", what, who, why)
        raise GatewayError(400, f"{what} rejected, the running configuration stays: {why}", param=param,
                           code="invalid_config")

    def _validated(self, build: Callable[[], Settings], who: str, what: str) -> Settings:
        """``build()``'s settings, checked as a whole; a refusal is logged, counted and raised as a 400."""
        try:
            new = build()
            check_settings(new)
        except ConfigError as exc:
            self.reloads.labels("rejected").inc()
            log.error("%s change by %s rejected: %s", what, who, exc)
            raise GatewayError(400, f"{what} rejected, the running configuration stays: {exc}",
                               code="invalid_config") from None
        return new

    async def _applied(self, new: Settings, who: str, action: str, content: bytes | None = None, *,
                       tell: bool = False) -> dict[str, Any]:
        """Apply ``new`` (``content``: the file's bytes it was read from, for a reload; ``tell``: a reload every
        other worker must make too), then tell who asked to be told what is in force now."""
        result = await self._reconfigure(new)
        self._known.saw(self._settings().auth.keys)
        if content is not None:
            self._content = content
        if self._on_applied is not None:
            async with self._reporting:
                try:
                    await asyncio.to_thread(self._on_applied, InForce(self._settings(), self._content,
                                                                        self._known.history(), tell))
                except OSError as exc:  # (the supervisor is gone: this worker is about to stop too)
                    log.warning("could not tell the supervisor what is in force: %s", exc)
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
