"""The admin API under ``/admin``: for operators, with a key that has the ``admin`` scope (client keys get 403,
and a gateway without keys serves no admin API). :class:`gateway.app.GatewayApp` authenticates before FastAPI
sees the request and leaves the key in ``scope["state"][CLIENT]``; the work is :class:`gateway.control.ControlPlane`'s.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request

from gateway.api.routes import CLIENT, JSONBytes
from gateway.auth import Client
from gateway.control import ControlPlane
from gateway.errors import GatewayError


def who(request: Request) -> str:
    client: Client | None = request.scope.get("state", {}).get(CLIENT)
    return f"key {client.name}" if client is not None else "a caller on the admin listener (no key)"


def build_admin_router(control: ControlPlane) -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"])

    @router.get("/backends", response_class=JSONBytes)
    async def backends() -> Any:
        """Every backend: its state (``serving``, ``unavailable``, ``draining`` while a drained backend still
        serves requests, ``drained`` once none is left), health, breaker, last load reading and its age,
        capacity and in-flight requests (this process's, and other replicas' where shared state counts them)."""
        return JSONBytes({"backends": control.backends()})

    @router.get("/backends/{name}", response_class=JSONBytes)
    async def backend(name: str) -> Any:
        """One backend, as in ``GET /admin/backends``; 404 for an unknown name."""
        return JSONBytes(control.backend(name))

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
        try:
            raw = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise GatewayError(400, "the body is not JSON", code="invalid_json") from None
        return JSONBytes(await control.set_routing(raw, who(request)))

    @router.get("/config", response_class=JSONBytes)
    async def config() -> Any:
        """The effective configuration (file, environment and defaults), every secret and URL credential
        replaced by ``[redacted]``."""
        return JSONBytes(control.config())

    return router
