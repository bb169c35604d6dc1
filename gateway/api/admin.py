"""The admin API under ``/admin`` and the admin listener (``server.admin_port``) that also serves the status page
(``/ui``). The work is :class:`gateway.control.ControlPlane`'s.

On the main listener the admin API needs a key with the ``admin`` scope (client keys get 403, and a gateway
without keys serves none); :class:`gateway.app.GatewayApp` authenticates before FastAPI sees the request and
leaves the key in ``scope["state"][CLIENT]``. The admin listener (:class:`AdminApp`) asks for such a key when one
is configured, and otherwise trusts its address (loopback by default).
"""

from __future__ import annotations

import ipaddress
from importlib import resources
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request, Response

from gateway import __version__
from gateway.api import errors
from gateway.api.proxy_endpoint import request_id
from gateway.api.routes import CLIENT, JSONBytes
from gateway.asgi import Receive, Scope, Send, header, send_body
from gateway.auth import Client, KeyStore
from gateway.control import ControlPlane
from gateway.errors import GatewayError

ADMIN = "/admin/"
NO_ADMIN = GatewayError(403, "the admin API needs API keys: configure auth.keys with a key whose scopes include "
                             "'admin'", code="admin_disabled").body()


def who(request: Request) -> str:
    client: Client | None = request.scope.get("state", {}).get(CLIENT)
    return f"key {client.name}" if client is not None else "a caller on the admin listener (no key)"


async def _json(request: Request) -> Any:
    try:
        return orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        raise GatewayError(400, "the body is not JSON", code="invalid_json") from None


def build_admin_router(control: ControlPlane) -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"])

    @router.get("/backends", response_class=JSONBytes)
    async def backends() -> Any:
        """Every backend: its state (``serving``, ``unavailable``, ``draining`` while a drained backend still
        serves requests, ``drained`` once none is left, ``removing`` while a removed one drains), health,
        breaker, last load reading and its age, capacity, in-flight requests (this process's, and other
        replicas' where shared state counts them) and ``recent``: the last minute's requests, errors, TTFT
        p50/p95, output tokens/s and routing decisions by reason (every worker's)."""
        return JSONBytes({"backends": await control.backends()})

    @router.post("/backends", response_class=JSONBytes)
    async def add_backend(request: Request) -> Any:
        """Add a backend: the body is one ``backends:`` entry, as in the configuration file (``name``,
        ``engine``, ``url``, ...), validated with the whole configuration (400 ``invalid_config`` naming the
        field; 409 ``backend_exists``). It is probed before it is routed to, and lasts until the next reload
        of the file (put it in the file to keep it). With shared state every worker and replica adds it."""
        return JSONBytes(await control.add_backend(await _json(request), who(request)))

    @router.get("/backends/{name}", response_class=JSONBytes)
    async def backend(name: str) -> Any:
        """One backend, as in ``GET /admin/backends``; 404 for an unknown name."""
        return JSONBytes(await control.backend(name))

    @router.delete("/backends/{name}", response_class=JSONBytes)
    async def remove_backend(name: str, request: Request) -> Any:
        """Remove a backend: drained first (no new request; those it serves finish, within the shutdown
        timeout), then dropped. Answers at once, the backend ``removing`` until it is gone. Lasts until the next
        reload of the file."""
        return JSONBytes(await control.remove_backend(name, who(request)))

    @router.post("/backends/{name}/drain", response_class=JSONBytes)
    async def drain(name: str, request: Request) -> Any:
        """Route no new request to the backend; the ones it serves finish. Answers its state (``draining``
        until its last request ends, then ``drained``). With shared state, every worker and replica drains
        it."""
        return JSONBytes(control.drain(name, who(request)))

    @router.post("/backends/{name}/undrain", response_class=JSONBytes)
    async def undrain(name: str, request: Request) -> Any:
        """Route to the backend again (when it is healthy)."""
        return JSONBytes(control.undrain(name, who(request)))

    @router.get("/status", response_class=JSONBytes)
    async def status() -> Any:
        """What the status page shows, in one reading: the backends (as in ``GET /admin/backends``) with their
        sparklines (``series``: requests, mean TTFT, output tokens/s and in-flight per ``step_seconds``, oldest
        first), the admission queue, routing decisions by reason, and the models (served ones with their
        backends; aliases with their splits and fallbacks)."""
        return JSONBytes(await control.status())

    @router.post("/reload", response_class=JSONBytes)
    async def reload(request: Request) -> Any:
        """Re-read the configuration file and apply it without dropping a stream or a queued request (as
        SIGHUP does). Answers what changed: ``sections``, backends ``added``, ``removed`` (drained first) and
        ``changed``, and ``restart_needed`` for changed sections only a restart applies. An invalid file is
        400 ``invalid_config`` naming the field at fault, and the running configuration stays."""
        return JSONBytes(await control.reload(f"the admin API ({who(request)})", tell=True))

    @router.put("/routing", response_class=JSONBytes)
    async def routing(request: Request) -> Any:
        """Change the routing section (any of ``policy``, ``profiles``, ``session_header``; the fields given
        replace the running ones), validated as a whole. It lasts until the next reload of the file."""
        return JSONBytes(await control.set_routing(await _json(request), who(request)))

    @router.get("/config", response_class=JSONBytes)
    async def config() -> Any:
        """The effective configuration (file, environment and defaults), every secret and URL credential
        replaced by ``[redacted]``."""
        return JSONBytes(control.config())

    return router


# -- the status page ----------------------------------------------------------------------------------------------
# three small files shipped in the package (no CDN, no build step); the page reads /admin/status every few
# seconds and drains with the admin API, sending the admin key it was given (kept in the tab's sessionStorage)
UI_FILES = {"/ui": ("index.html", "text/html; charset=utf-8"), "/ui/": ("index.html", "text/html; charset=utf-8"),
            "/ui/ui.js": ("ui.js", "text/javascript; charset=utf-8"),
            "/ui/ui.css": ("ui.css", "text/css; charset=utf-8")}
UI_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
}


def build_ui_router() -> APIRouter:
    folder = resources.files("gateway.api") / "ui"
    files = {path: (folder.joinpath(name).read_bytes(), kind) for path, (name, kind) in UI_FILES.items()}
    router = APIRouter(include_in_schema=False)

    def serve(path: str) -> None:
        body, kind = files[path]

        async def page() -> Response:
            return Response(body, media_type=kind.split(";")[0], headers={**UI_HEADERS, "Content-Type": kind})

        router.add_api_route(path, page, methods=["GET"])

    for path in files:
        serve(path)
    return router


def _local_host(value: bytes | None) -> bool:
    """A Host header naming loopback or an address (not a DNS name another site could point at this one)."""
    if not value:
        return False
    host = value.decode("latin-1")
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def same_origin(scope: Scope) -> bool:
    """No ``Origin`` (curl, scripts), or one naming the host the request was sent to (the status page)."""
    origin = header(scope, b"origin")
    if origin is None:
        return True
    host = header(scope, b"host")
    return host is not None and origin.partition(b"://")[2] == host


CROSS_ORIGIN = GatewayError(403, "a change through the admin API from a browser must come from the listener's "
                            "own status page (Origin differs from Host)", code="cross_origin_refused")


class AdminApp:
    """The admin listener's ASGI app (``server.admin_port``): the admin API and the status page. It asks for a
    key with the ``admin`` scope when some key has it (client keys never reach it); otherwise it trusts its
    address (loopback by default), and then answers only requests sent to an address or ``localhost`` by
    name, so that a web page cannot reach it through a name of its own (DNS rebinding). A change (any method
    but GET and HEAD) from a browser must come from a page of the listener's own origin (no cross-site
    requests). The status page's files need no key: they hold no data. No lifespan: the main app starts and
    stops the gateway."""

    def __init__(self, control: ControlPlane, keys: KeyStore) -> None:
        self._keys = keys
        self.fastapi = FastAPI(title="LLM gateway admin", version=__version__, docs_url=None, redoc_url=None,
                               redirect_slashes=False)
        errors.install(self.fastapi)
        self.fastapi.include_router(build_admin_router(control))
        self.fastapi.include_router(build_ui_router())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            rid = [(b"x-request-id", request_id(scope).encode())]
            keyed = any("admin" in k.scopes for k in self._keys.settings.keys)
            if not keyed and not _local_host(header(scope, b"host")):
                refusal = GatewayError(403, "the admin listener trusts its address only for requests sent to an "
                                       "IP address or localhost: configure a key with the 'admin' scope to reach "
                                       "it by name", code="admin_host_refused")
                await send_body(send, 403, refusal.body(), rid)
                return
            if scope["method"] not in ("GET", "HEAD") and not same_origin(scope):
                await send_body(send, 403, CROSS_ORIGIN.body(), rid)
                return
            if keyed and scope["path"] not in UI_FILES:
                try:
                    client = self._keys.authenticate(header(scope, b"authorization"), header(scope, b"x-api-key"),
                                                     "admin")
                except GatewayError as exc:
                    await send_body(send, exc.status, exc.body(), rid)
                    return
                scope.setdefault("state", {})[CLIENT] = client
        await self.fastapi(scope, receive, send)
