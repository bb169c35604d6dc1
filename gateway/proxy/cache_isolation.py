"""A request, on its way to an engine, kept to its cache domain (:mod:`gateway.routing.cache_domain`).

While several cache domains exist, an engine that can partition its prefix cache (``EngineSpec.cache_isolation``:
vLLM's and SGLang's ``cache_salt``) gets the domain's salt, further partitioned by the client's own ``cache_salt``
if it sent one, never replaced by it: a prefix another domain cached is then never reused, and what the engine
reports as cached is the domain's own. An engine that cannot (llama.cpp, TabbyAPI) reuses whatever any request
cached; there the gateway removes from the answers what would show it (:mod:`gateway.proxy.cache_figures`) and
does not ask the engine for more such reports (``cache_report_params``). What remains is timing: a prompt whose
prefix another domain cached still starts sooner there.
"""

from __future__ import annotations

from typing import Any

from gateway.engines.spec import EngineSpec
from gateway.errors import GatewayError
from gateway.routing.request import POOLING_ROUTES, RouteRequest

GENERATION_ROUTES = frozenset({"chat", "completions"})


def isolate(body: dict[str, Any], request: RouteRequest, spec: EngineSpec, api: str) -> bool:
    """Make ``body``, about to go to an engine of ``spec`` as ``api`` (a route, or the agent API passed through
    natively), keep to the request's cache domain. False when it cannot: an agent API the engine serves but
    cannot isolate, whose own answer the gateway does not rewrite (send the chat translation instead).
    Raises a 400 for a client's ``cache_salt`` the salted request could not carry (not a non-empty string)."""
    domain = request.cache_domain
    if not domain.isolated or api in POOLING_ROUTES:  # (pooling answers report no cache)
        return True
    generation = api in GENERATION_ROUTES
    field = spec.cache_isolation
    if field is not None and (generation or api in spec.isolated_native_apis):
        own = body.get("cache_salt")  # (the client's, as it sent it)
        if own is not None and (not isinstance(own, str) or not own):
            raise GatewayError(400, "'cache_salt' must be a non-empty string if provided", param="cache_salt",
                               code="invalid_value")
        body[field] = domain.engine_salt(own)
        return True
    if not generation:
        return False
    for param in spec.cache_report_params:
        body.pop(param, None)
    return True


def hidden_figures(request: RouteRequest, spec: EngineSpec) -> tuple[tuple[str, ...], ...]:
    """The fields to remove from what an engine of ``spec`` answers this request (:mod:`gateway.proxy.cache_figures`):
    its cache figures where it shares one cache between several domains (none otherwise)."""
    if not request.cache_domain.isolated or spec.cache_isolation is not None:
        return ()
    return spec.cache_figures
