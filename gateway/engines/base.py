"""The engine adapter contract, and helpers every adapter shares.

An adapter reads one engine's control plane as its :class:`~gateway.engines.spec.EngineSpec` describes it:
where its health, load, capacity and models live and what its answers mean. It is handed an
``httpx.AsyncClient`` already pointed at the backend (base URL, auth header, timeouts); errors from httpx
are mapped here, at the boundary, to :class:`BackendError`. Request-side translation (``prepare_body``) also
lives here, so engine quirks never leak into the proxy.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import httpx
import orjson

from gateway.engines import exposition, readings
from gateway.engines.spec import EngineSpec
from gateway.pool.state import Capacity, Health, KvEventSource, LoadRecord, Probe
from gateway.structured import CONSTRAINT_FIELDS, Constraint, grammar_in


class BackendError(Exception):
    """A backend could not be reached or answered something unusable."""


class EngineAdapter:
    """Base adapter: an OpenAI-compatible server with a health path and ``/v1/models``, reading load from
    ``/metrics`` when its spec names metrics. ``spec`` holds the engine's facts; a subclass overrides only
    the methods whose behaviour is code (parsing the engine's own load or capacity documents)."""

    spec: ClassVar[EngineSpec] = EngineSpec(name="openai")

    @property
    def engine(self) -> str:
        return self.spec.name

    @property
    def structured(self) -> frozenset[str]:
        return self.spec.structured

    # --- control plane -------------------------------------------------------------------------------
    async def probe(self, client: httpx.AsyncClient) -> Probe:
        path = self.spec.health_path
        return self.read_probe(path, await get(client, path))

    def read_probe(self, path: str, response: httpx.Response, loading: str = "is loading its model") -> Probe:
        """What ``response`` to a health probe of ``path`` says (``loading``: what its loading status means)."""
        if response.status_code == 200:
            return Probe(Health.READY)
        if response.status_code == self.spec.loading_status:
            return Probe(Health.LOADING, f"{self.spec.name} {loading} ({path} answered HTTP {response.status_code})")
        return Probe(Health.DOWN, f"{path} answered HTTP {response.status_code}")

    async def read_load(self, client: httpx.AsyncClient) -> LoadRecord | None:
        """The engine's own view of its load, or None when it exposes none."""
        names = self.spec.metric_names
        if not names:
            return None
        response = await get(client, "/metrics")
        if response.status_code != 200:
            raise BackendError(f"/metrics answered HTTP {response.status_code}")
        # (vLLM under data parallelism writes kv_cache_usage_perc per engine rank: the fullest is the reading)
        values = parse_metrics(response.text, names.values(), [names["kv_usage"]] if "kv_usage" in names else [])
        queue = names.get("queue_histogram")
        figures = readings.Figures()
        running = figures.count("running", values.get(names.get("running", "")))
        waiting = figures.count("waiting", values.get(names.get("waiting", "")))
        kv_usage = figures.fraction("kv_usage", values.get(names.get("kv_usage", "")))
        histogram = figures.histogram("queue_histogram", parse_histogram(response.text, queue) if queue else None)
        return LoadRecord(running, waiting, kv_usage, time.monotonic(), histogram, tuple(figures.rejected))

    async def read_capacity(self, client: httpx.AsyncClient) -> Capacity:
        return Capacity(slots=self.spec.default_slots)

    async def measure_step(self, client: httpx.AsyncClient) -> float | None:
        """Seconds a step of the engine's loop takes with one short plain request alone on it (what it says it
        took a token), for engines whose loop is watched (EngineSpec.load_waits_for_loop); None where unknown."""
        return None

    async def read_kv_events(self, client: httpx.AsyncClient) -> KvEventSource:
        """Where the engine says it publishes its KV-cache events (``kv_events: discover``); a BackendError when
        it shows none (publishing off, a release that does not say, a setup the gateway cannot follow)."""
        raise BackendError(f"engine {self.spec.name} publishes no KV-cache events")

    async def list_models(self, client: httpx.AsyncClient) -> list[str]:
        """The models the backend serves, as listed: at most ``readings.MAX_MODELS`` + 1 names (one more than the
        pool keeps, so it can tell that some were left out)."""
        path = self.spec.models_path
        doc = await get_json(client, path)
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            raise BackendError(f"{path} has no 'data' list")
        return listed_models(item.get("id") for item in data if isinstance(item, dict))

    # --- data plane ----------------------------------------------------------------------------------
    def prepare_body(self, route: str, body: dict[str, Any], constraint: Constraint | None = None) -> dict[str, Any]:
        """Translate an OpenAI request body (``route``: chat, completions or embeddings) into what this
        engine needs. May modify ``body`` in place.

        Streaming requests always ask for usage so the gateway's token accounting is exact; the proxy
        removes the usage chunk again when the client did not ask for it. A structured-output constraint,
        whatever field it came in, is removed and written in this engine's native fields; the routing
        filter has made sure the engine can honour it.
        """
        if body.get("stream") is True:
            options = body.get("stream_options")
            body["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {
                "include_usage": True
            }
        if constraint is not None and constraint.kind not in ("tool_call", "strict_tools"):
            for name in CONSTRAINT_FIELDS:
                body.pop(name, None)
            body.pop("response_format", None)
            body.update(self.constraint_fields(constraint))
        if route == "rerank":
            # Jina's document objects ({"text": ...}), which validation accepts, as the plain strings every
            # engine's rerank takes (llama.cpp and SGLang take nothing else)
            documents = body.get("documents")
            if isinstance(documents, list) and any(isinstance(d, dict) for d in documents):
                body["documents"] = [d["text"] if isinstance(d, dict) else d for d in documents]
        return body

    def rewrite_answer(self, route: str, model: str, body: dict[str, Any] | None = None,
                       ) -> Callable[[bytes], bytes] | None:
        """How to turn this engine's non-streamed answer on ``route`` (for ``model``, asked with the client's
        ``body``) into the shape the gateway serves, where the two differ (None: they do not, and the answer
        passes byte for byte). The function
        raises ValueError on an answer it cannot read."""
        return None

    def constraint_fields(self, constraint: Constraint) -> dict[str, Any]:
        """The request fields that carry ``constraint`` in this engine's dialect (OpenAI's, here)."""
        if constraint.kind == "json_object":
            return {"response_format": {"type": "json_object"}}
        if constraint.kind == "json_schema":
            return {"response_format": {"type": "json_schema", "json_schema": {
                "name": constraint.name, "schema": constraint.schema, "strict": constraint.strict}}}
        raise ValueError(f"{self.spec.name} cannot express {constraint.describe()}")


# --- helpers ----------------------------------------------------------------------------------------------
IDENTITY = {"accept-encoding": "identity"}  # (httpx asks for gzip, deflate and more by default)


async def get(client: httpx.AsyncClient, path: str) -> httpx.Response:
    """``GET path``, its body read whole up to ``readings.MAX_ANSWER_BYTES`` (a larger answer is a BackendError:
    no health, load or models answer is that large, and reading one would hold memory and the event loop)."""
    return await fetch(client, "GET", path)


async def fetch(client: httpx.AsyncClient, method: str, path: str, payload: Any = None) -> httpx.Response:
    """As :func:`get`, with ``method`` and a JSON ``payload`` if any."""
    limit = readings.MAX_ANSWER_BYTES
    try:
        async with client.stream(method, path, headers=IDENTITY, json=payload) as response:
            declared = response.headers.get("content-length", "")
            if declared.isdecimal() and len(declared) < 20 and int(declared) > limit:
                raise BackendError(f"{method} {path} answered {int(declared)} bytes, more than the {limit} a health, "
                                   f"load or models answer may be")
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                # (asked for none: decoded, 64 KiB of gzip became ~67 MB in one piece before the bound was
                # checked, ~110 ms of the event loop each, and memory that piled up: sweep 13)
                raise BackendError(f"{method} {path} answered compressed ({encoding[:40]!r}), which the gateway "
                                   f"does not ask for and does not decode")
            body = bytearray()
            async for piece in response.aiter_bytes():  # (identity: as sent)
                body += piece
                if len(body) > limit:
                    raise BackendError(f"{method} {path} answered more than the {limit} bytes a health, load or models "
                                       f"answer may be")
    except httpx.TimeoutException as exc:
        raise BackendError(f"{method} {path} timed out ({type(exc).__name__})") from None
    except httpx.HTTPError as exc:
        raise BackendError(f"{method} {path} failed: {type(exc).__name__}: {exc}") from None
    # (the body as read: never encoded, see above)
    return httpx.Response(response.status_code, content=bytes(body), request=response.request,
                          headers={"content-type": response.headers.get("content-type", "")})


async def get_json(client: httpx.AsyncClient, path: str) -> Any:
    response = await get(client, path)
    if response.status_code != 200:
        raise BackendError(f"GET {path} answered HTTP {response.status_code}")
    return json_of(response, path)


PYTHON_JSON_BYTES = 256 * 1024  # answers orjson refuses (NaN, huge integers) are read by Python's json up to this


def json_of(response: httpx.Response, path: str) -> Any:
    """The answer's JSON document; BackendError when it is not JSON (an HTML maintenance page, a cut body).
    Python's own reader takes what orjson refuses but a Python engine writes: ``NaN`` and ``Infinity`` (read as
    None) and integers past 64 bits (then left out by :mod:`gateway.engines.readings`)."""
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        pass
    if len(response.content) > PYTHON_JSON_BYTES:  # (Python's reader is ~25x slower, on the event loop: 4 MiB of
        # arrays and a NaN took 0.48 s every scrape, sweep 10)
        raise BackendError(f"GET {path} did not answer JSON orjson reads (and is too large for Python's reader)")
    try:
        return json.loads(response.content, parse_constant=lambda _: None)
    except ValueError:  # (JSONDecodeError, an integer of more than 4,300 digits, bytes that are not UTF-8)
        raise BackendError(f"GET {path} did not answer JSON") from None


def listed_models(ids: Iterable[Any]) -> list[str]:
    """The well-formed model names among ``ids``, in order, at most ``readings.MAX_MODELS`` + 1 of them."""
    names: list[str] = []
    for value in ids:
        name = readings.model_name(value)
        if name is not None:
            names.append(name)
            if len(names) > readings.MAX_MODELS:
                break
    return names


def parse_histogram(text: str, name: str) -> tuple[tuple[tuple[str, float], ...], float, float] | None:
    """A histogram family summed across its label sets (engine ranks, models): ((le, cumulative), ...), sum,
    count, as the engine wrote them (see ``readings.histogram``); None when the family is absent. Only its own
    lines are read (:mod:`gateway.engines.exposition`)."""
    try:
        return exposition.histogram(text, name)
    except ValueError as exc:
        raise BackendError(f"/metrics is not Prometheus text: {exc}") from None


def parse_metrics(text: str, wanted: Iterable[str], largest: Iterable[str] = ()) -> dict[str, float]:
    """Sum the samples of the wanted metrics across their labels (e.g. one per model or engine rank), by
    sample name as the exposition writes it (a counter's with its ``_total``); of those in ``largest`` (shares
    per rank) take the largest. Only their own lines are read
    (:mod:`gateway.engines.exposition`): parsing a whole vLLM exposition with prometheus_client stalled the
    event loop for milliseconds per scrape."""
    try:
        return exposition.summed(text, tuple(wanted), frozenset(largest))
    except ValueError as exc:
        raise BackendError(f"/metrics is not Prometheus text: {exc}") from None


def native_grammar(constraint: Constraint, dialects: tuple[str, ...]) -> str:
    converted = grammar_in(constraint, dialects)
    if converted is None:
        raise ValueError(f"no faithful conversion of {constraint.describe()} to {', '.join(dialects)}")
    return converted[1]
