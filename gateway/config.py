"""Settings: one YAML file plus ``GATEWAY_*`` environment overrides, validated by pydantic.

Environment variables win over the file and nest with ``__``: ``GATEWAY_SERVER__PORT=9000``,
``GATEWAY_ROUTING__POLICY=round-robin``, ``GATEWAY_TIMEOUTS__TOTAL=120``. A bad file raises
:class:`ConfigError` whose message names each offending field (``backends[1] (vllm-a).url: ...``).
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

# (ConfigError lives with the file's reading, a leaf; it is this module's error as much)
from gateway.config_file import ConfigError as ConfigError
from gateway.config_file import read_config_file, read_config_settled, read_yaml

Scope = Literal["inference", "metrics", "admin"]  # what a gateway API key may use


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address; anything else (``0.0.0.0``, a name, an interface's address) may be
    reached from other machines."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    max_response_bytes: int = Field(default=64 << 20, ge=1 << 20, description="larger non-streamed answers: 502")
    max_response_values: int = Field(
        default=5_000_000, ge=10_000,
        description="most JSON values in one non-streamed answer, weighted by what parsing each costs the event loop "
                    "(measured: a value 1, a string 2, an object or array 6; ~0.05 us a unit, so the default is "
                    "~0.25 s); more: 502. Counted in the bytes before parsing. Embeddings of 2,048 inputs of 1,024 "
                    "dimensions are ~2.1M; logprobs with top_logprobs 20 ~330 a token")
    shutdown_timeout: float = Field(default=30.0, ge=0, description="seconds in-flight streams get to finish")
    max_header_bytes: int = Field(default=64 * 1024, ge=1024,
                                  description="request line plus headers at most; larger requests get 431")
    header_timeout: float = Field(default=10.0, gt=0,
                                  description="seconds a client has to send a request's line and headers")
    body_timeout: float = Field(default=30.0, gt=0,
                                description="longest wait for the next piece of a request body; then 408")
    keepalive_timeout: float = Field(
        default=75.0, gt=0,
        description="an idle keep-alive connection is closed after; longer than clients keep theirs (httpx and the "
                    "OpenAI SDKs: 5 s), else a request sent as the gateway closes its connection fails")
    max_connections: int | None = Field(
        default=None, gt=0,
        description="client connections at most (more are refused at once); default: what the descriptor "
                    "limit leaves after headroom for upstream connections and health checks")
    docs: bool = Field(default=False, description="serve /docs and /redoc (their pages load scripts from a CDN)")
    admin_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="a second listener serving only the admin API (/admin/...), on admin_host; None: none (the "
                    "admin API is then reached on the main port with an admin-scoped key)")
    admin_host: str = Field(default="127.0.0.1", description="the admin listener's address (loopback by default)")
    reload_watch_seconds: float | None = Field(
        default=None, gt=0, description="poll the configuration file this often and reload it when it changes "
                                        "(SIGHUP and POST /admin/reload reload it too)")
    reload_settle_seconds: float = Field(
        default=2.0, gt=0, description="the file watch reloads a changed file only once its content has stayed "
                                       "the same this long, and applies exactly what it read: a file being "
                                       "rewritten in place is never applied half-written")
    workers: int | Literal["auto"] = Field(
        default=1, description="processes serving the port (SO_REUSEPORT), or auto: one per CPU this process may "
                               "use; more than one needs state.url (limits, slots and sessions live there)")

    def admin_on_network(self) -> bool:
        """Whether the admin listener is configured, on an address other than loopback (reachable from other
        machines)."""
        return self.admin_port is not None and not is_loopback(self.admin_host)

    def worker_count(self) -> int:
        if self.workers == "auto":
            return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        return self.workers

    @field_validator("workers")
    @classmethod
    def _workers(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 256:
            raise ValueError("workers: between 1 and 256, or auto")
        return value


class LimitSettings(_Strict):
    """Per-request limits; beyond them a 400 naming the field."""

    max_messages: int = Field(default=4096, gt=0, description="most messages in one chat or Anthropic Messages "
                                                              "request; most input items of one Responses request")
    max_documents: int = Field(default=1024, gt=0, description="most documents in one rerank request")
    max_inputs: int = Field(default=2048, gt=0, description="most inputs in one embeddings request (OpenAI's cap), "
                                                            "most prompts in one completions request")
    max_tools: int = Field(default=512, gt=0, description="most tools one request offers")
    max_json_containers: int = Field(
        default=100_000, gt=0, description="most JSON objects and arrays in one request body (each costs the "
                                           "gateway to decode and translate: 8 MiB of empty arrays, ~1 s)")
    max_json_values: int = Field(
        default=2_000_000, gt=0, description="most JSON values in one request body, weighted by what decoding each "
                                             "costs (a value 1, a string 2, an object or array 6, an object's key "
                                             "(any ':') 5 more: ~0.05 us a unit, ~0.1 s in all; 700,000 distinct "
                                             "keys in one object, one container, took 0.23-0.31 s)")
    max_tokens: int = Field(default=131072, gt=0, description="largest max_tokens / max_completion_tokens accepted")
    max_n: int = Field(default=128, gt=0, description="most choices (n, best_of) one request asks for (OpenAI's cap)")
    max_stop: int = Field(
        default=32, gt=0, description="most stop sequences one request gives (stop, stop_sequences, and the engines' "
                                      "bad_words and stop_regex; OpenAI's cap is 4): engines check each at every "
                                      "token they generate, for every request beside it (900,000 of them held "
                                      "other keys' streams to a tenth of their pace)")
    max_stop_chars: int = Field(default=4096, gt=0, description="most characters of one request's stop sequences "
                                                                "in all")
    max_token_entries: int = Field(
        default=2048, gt=0, description="most entries of one request's per-token lists and maps (logit_bias, "
                                        "stop_token_ids, allowed_token_ids): an engine reads them at every token")
    max_nesting: int = Field(default=64, ge=4, le=200,
                             description="deepest nesting of a JSON schema, regex group or grammar expression")
    max_constraint_bytes: int = Field(default=128 * 1024, gt=0,
                                      description="largest JSON schema, regex or grammar accepted (serialised)")
    max_grammar_rules: int = Field(default=2000, gt=0, description="most rules in a GBNF, EBNF or Lark grammar")
    validation_timeout: float = Field(default=2.0, gt=0,
                                      description="seconds a constraint's validation may take off the event loop")
    validation_queue_timeout: float = Field(
        default=15.0, gt=0, description="seconds a constraint may wait for a free validation worker (a burst of "
                                        "large constraints queues; past this the request gets a 503 to retry)")
    output_check_timeout: float = Field(
        default=0.5, gt=0, description="seconds checking a finished answer against its constraint may take in a "
                                       "validation worker, waiting for one included (structured_output."
                                       "validate_outputs); past it the answer reaches the client unchecked")


class ResponsesSettings(_Strict):
    """``/v1/responses``: the gateway keeps recent responses itself, so ``previous_response_id`` continues a
    conversation on whichever backend routing picks next. Bounded in entries and bytes, in all and per API key;
    entries expire."""

    store_entries: int = Field(default=10_000, ge=0, description="most responses kept (0: none kept)")
    store_bytes: int = Field(default=256 * 1024 * 1024, ge=0,
                             description="most bytes held (each conversation's JSON, its id and a fixed cost per "
                                         "entry); per process, and in Redis for the whole fleet")
    store_entries_per_key: int = Field(default=1_000, gt=0,
                                       description="most responses kept of one API key (its own oldest go first)")
    store_bytes_per_key: int = Field(default=32 * 1024 * 1024, gt=0,
                                     description="most bytes held of one API key (its own oldest go first)")
    store_ttl_seconds: float = Field(default=3600.0, gt=0, description="a response is forgotten after this long")


class RetrySettings(_Strict):
    """Failover before any byte reached the client: connection errors, first-byte timeouts and the engine's
    retryable statuses go to the next-ranked backend."""

    max_attempts: int = Field(default=3, ge=1, le=10)
    max_seconds: float = Field(default=30.0, gt=0, description="no new attempt after this long since arrival")


class BreakerSettings(_Strict):
    """Outlier ejection per backend: consecutive failures or a failure ratio over a window open it."""

    consecutive_failures: int = Field(default=5, ge=1)
    failure_ratio: float = Field(default=0.5, gt=0, le=1)
    window_seconds: float = Field(default=30.0, gt=0)
    min_requests: int = Field(default=20, ge=1, description="in the window, before the ratio counts")
    cooldown_seconds: float = Field(default=5.0, gt=0, description="first ejection; doubles while probes fail")
    max_cooldown_seconds: float = Field(default=120.0, gt=0)


PRIORITY_RANGE = 1000  # priorities are integers in [-1000, 1000]; higher goes first
Priority = int | str  # an integer, or the name of a band


class BandSettings(_Strict):
    priority: int = Field(ge=-PRIORITY_RANGE, le=PRIORITY_RANGE)
    max_wait_seconds: float | None = Field(
        default=None, ge=0, description="its requests' default deadline in the queue (default: admission's)")
    max_saturation: float | None = Field(
        default=None, gt=0, le=1,
        description="its requests are admitted only while the model's slots in use, over all its ready "
                    "backends' slots, are below this share: the rest stays free for higher bands (None: up to "
                    "every slot)")


def _default_bands() -> dict[str, BandSettings]:
    return {"critical": BandSettings(priority=100), "standard": BandSettings(priority=0),
            "sheddable": BandSettings(priority=-100, max_saturation=0.9)}


class AdmissionSettings(_Strict):
    """When every eligible backend of a model is at its max_concurrency, requests wait here: by priority,
    then in weighted fair shares between API keys (docs/flow-control.md)."""

    queue_size: int = Field(default=1024, ge=0, description="waiting requests at most; beyond them 429")
    max_wait_seconds: float = Field(default=30.0, ge=0, description="the longest any request waits for a slot")
    bands: dict[str, BandSettings] = Field(
        default_factory=_default_bands,
        description="named priorities: a key's priority or the x-gateway-priority header may name one; metrics "
                    "label a request with the band at or below its priority")
    default_priority: Priority = Field(default="standard", description="for keys that set none, and anonymous "
                                                                       "traffic")
    shed_on_predicted_wait: bool = Field(
        default=True, description="refuse at once (429, Retry-After) a request whose predicted wait exceeds its "
                                  "deadline, instead of holding it until the deadline passes")
    reserve_for_light_keys: bool = Field(
        default=True, description="while a key that keeps up with its traffic (none of its requests waits) is "
                                  "active, keep its recent peak of requests in flight plus one slot free for it (or "
                                  "its likely arrivals before the model next frees a slot, if more): "
                                  "another key's backlog cannot take them (docs/flow-control.md)")
    reserve_window_seconds: float = Field(
        default=10.0, gt=0, le=300, description="how far back a light key's peak of requests in flight is taken")
    reserve_max_share: float = Field(
        default=0.5, ge=0, le=1, description="the most of a model's slots kept free for light keys, together")

    @field_validator("bands")
    @classmethod
    def _bands(cls, bands: dict[str, BandSettings]) -> dict[str, BandSettings]:
        if not bands:
            raise ValueError("at least one band")
        for name in bands:
            if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", name):
                raise ValueError(f"band name {name!r}: lowercase letters, digits, '-' and '_', 32 at most")
        values = [b.priority for b in bands.values()]
        if len(set(values)) != len(values):
            raise ValueError("two bands with one priority")
        return dict(sorted(bands.items(), key=lambda item: -item[1].priority))

    @model_validator(mode="after")
    def _default_known(self) -> AdmissionSettings:
        self.priority_of(self.default_priority, "default_priority")
        return self

    def priority_of(self, value: Priority, what: str = "priority") -> int:
        """``value`` (an integer or a band's name) as an integer priority; ValueError names ``what``."""
        if isinstance(value, str):
            band = self.bands.get(value)
            if band is None:
                raise ValueError(f"{what}: {value!r} is no band (bands: {', '.join(self.bands)})")
            return band.priority
        if not -PRIORITY_RANGE <= value <= PRIORITY_RANGE:
            raise ValueError(f"{what}: {value} is outside [-{PRIORITY_RANGE}, {PRIORITY_RANGE}]")
        return value

    def band_of(self, priority: int) -> str:
        """The band a priority falls in: the highest band at or below it, else the lowest band."""
        for name, band in self.bands.items():  # (highest first)
            if band.priority <= priority:
                return name
        return next(reversed(self.bands))

    def max_saturation_of(self, priority: int) -> float | None:
        return self.bands[self.band_of(priority)].max_saturation

    def max_wait_of(self, priority: int) -> float:
        band = self.bands[self.band_of(priority)]
        return band.max_wait_seconds if band.max_wait_seconds is not None else self.max_wait_seconds


class ApiKeySettings(_Strict):
    name: str = Field(min_length=1)
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                                   description="hex SHA-256 of the key (the key itself is never stored)")
    key_env: str | None = Field(default=None, description="environment variable holding the key")
    models: list[str] = Field(default_factory=lambda: ["*"], description="allowed models (shell patterns)")
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    max_in_flight: int | None = Field(
        default=None, gt=0, description="requests of this key in flight at once (with state.url: across every "
                                        "worker and replica); past it 429 concurrency_limit at once")
    scopes: list[Scope] = Field(
        default_factory=lambda: list[Scope](["inference"]),
        description="inference: the /v1 API; metrics: /metrics when auth.protect_metrics is on; admin: the "
                    "operator API under /admin")
    priority: Priority | None = Field(
        default=None, description="its requests' priority: an integer (higher first) or a band's name "
                                  "(default: admission.default_priority)")
    max_priority: Priority | None = Field(
        default=None, description="the highest priority its x-gateway-priority header may ask for (default: "
                                  "its own priority, so the header can only lower it)")
    weight: float = Field(default=1.0, gt=0, le=1000,
                          description="its share among keys of one priority when a model's backends are full")
    cache_domain: str | None = Field(
        default=None, min_length=1, max_length=128,
        description="keys in one cache domain profit from each other's cached prompts; a key profits from no "
                    "other domain's (default: its own name, a domain of its own)")

    @model_validator(mode="after")
    def _one_source(self) -> ApiKeySettings:
        if (self.key_sha256 is None) == (self.key_env is None):
            raise ValueError("set exactly one of key_sha256 or key_env")
        if self.key_env is not None and not os.environ.get(self.key_env):
            raise ValueError(f"key_env: environment variable {self.key_env} is not set")
        return self

    def digest(self) -> str:
        if self.key_sha256 is not None:
            return self.key_sha256
        import hashlib

        return hashlib.sha256(os.environ[str(self.key_env)].encode()).hexdigest()


class AuthSettings(_Strict):
    """Gateway API keys. With none configured, the gateway is open. A reload may take every key away only from a
    file that says ``open: true`` (a file cut short must not open the gateway: :mod:`gateway.config_reload`)."""

    keys: list[ApiKeySettings] = Field(default_factory=list)
    open: bool = Field(default=False, description="serve without API keys, on purpose: what a reload that removes "
                                                  "every key needs the file to say (with keys set: refused)")
    protect_health: bool = Field(default=False, description="/health and /ready need a key too")
    protect_metrics: bool = Field(default=False, description="/metrics needs a key with the metrics scope")
    reserve_tokens: int = Field(
        default=1024, gt=0,
        description="tokens_per_minute: completion tokens reserved on admission for a request without max_tokens")
    cache_salt_env: str | None = Field(
        default=None,
        description="environment variable holding a secret the cache domains' salts are keyed with (the same "
                    "for every replica); default: each domain's salt is keyed with its own keys' digests, so "
                    "rotating a domain's keys starts its engine caches afresh")

    @model_validator(mode="after")
    def _salt_secret(self) -> AuthSettings:
        if self.cache_salt_env is not None and not os.environ.get(self.cache_salt_env):
            raise ValueError(f"cache_salt_env: environment variable {self.cache_salt_env} is not set")
        return self

    def has_admin_key(self) -> bool:
        return any("admin" in key.scopes for key in self.keys)

    @model_validator(mode="after")
    def _each_key_once(self) -> AuthSettings:
        # a key is known by its name to everything that outlives a request (a reload's kept keys and their
        # buckets, the shared state's counters, the logs): two of one name were merged into one on reload, the
        # limited key taking the other's scopes; and one key under two names is either of them
        names: dict[str, str] = {}
        for key in self.keys:
            if key.name in names.values():
                raise ValueError(f"keys: two keys are named {key.name!r}: give each key a name of its own")
            digest = key.digest()
            if digest in names:
                raise ValueError(f"keys: {names[digest]!r} and {key.name!r} are the same key (the same key_sha256, "
                                 "or key_env values that are equal): list each key once")
            names[digest] = key.name
        return self

    @model_validator(mode="after")
    def _open_or_keys(self) -> AuthSettings:
        if self.open and self.keys:
            raise ValueError(f"open: true says the gateway serves without API keys, but keys lists {len(self.keys)}: "
                             "remove one or the other")
        return self


class KvEventsSettings(_Strict):
    """Where a vLLM or SGLang server publishes its KV-cache events (``--kv-events-config``): its ``endpoint``
    and ``replay_endpoint`` with the host this gateway reaches it at (``tcp://10.0.0.5:5557``), or only the
    ports, the host then being the backend's own (what a DNS group of replicas needs); or ``discover``: as the
    engine says once it is ready (vLLM ``/kv_event_sources``, SGLang ``/server_info``), a wildcard host it
    binds being the backend's own. ``kv_events: discover`` is short for ``{discover: true}``."""

    discover: bool = Field(default=False, description="read the endpoints and topic from the engine")
    endpoint: str | None = Field(default=None, description="tcp://host:port of the engine's PUB socket")
    port: int | None = Field(default=None, ge=1, le=65535, description="the PUB port on the backend's host")
    replay_endpoint: str | None = Field(default=None, description="tcp://host:port of its replay socket")
    replay_port: int | None = Field(default=None, ge=1, le=65535, description="the replay port on the backend's host")
    topic: str = Field(default="", description="the topic the engine publishes under (a prefix match)")
    block_size: int | None = Field(default=None, gt=0, description="tokens per block; default: as events say")
    silence_seconds: float = Field(
        default=10.0, gt=0, description="no event this long after a request that must store new blocks: the "
                                        "stream is presumed dead and routing falls back to the approximate index")
    history_seconds: float = Field(
        default=60.0, ge=0, description="after events were lost beyond the engine's replay buffer, the index is "
                                        "rebuilt from new events for this long before routing trusts it")

    @model_validator(mode="after")
    def _one_address(self) -> KvEventsSettings:
        if self.discover:
            typed = [name for name in ("endpoint", "port", "replay_endpoint", "replay_port", "topic")
                     if name in self.model_fields_set]
            if typed:
                raise ValueError(f"discover reads {', '.join(typed)} from the engine: set one or the other")
            return self
        if (self.endpoint is None) == (self.port is None):
            raise ValueError("set either endpoint or port")
        if self.replay_endpoint is not None and self.replay_port is not None:
            raise ValueError("set replay_endpoint or replay_port, not both")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (value.startswith("ipc://") or _tcp_address(value)):
                raise ValueError(f"{name} must be tcp://host:port (or ipc://path), the address to connect to")
        return self

    def addresses(self, backend_url: str) -> tuple[str, str | None]:
        """The PUB and replay addresses to connect to for a backend at ``backend_url`` (typed ones; not with
        ``discover``)."""
        host = urlsplit(backend_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        endpoint = self.endpoint or f"tcp://{host}:{self.port}"
        replay = self.replay_endpoint or (f"tcp://{host}:{self.replay_port}" if self.replay_port else None)
        return endpoint, replay


def _tcp_address(value: str) -> bool:
    """Whether ``value`` is tcp://host:port (no wildcard: an address to connect to)."""
    parts = urlsplit(value)
    try:
        return parts.scheme == "tcp" and bool(parts.hostname) and parts.port is not None and "*" not in value
    except ValueError:  # (a port that is no number)
        return False


class BackendSettings(_Strict):
    """One backend, or with ``dns`` a group of replicas: every address the name resolves to (a Kubernetes
    headless Service) becomes a backend ``<name>-<address>`` at ``scheme://address:port``, re-resolved every
    ``discovery.interval`` seconds."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    engine: str = Field(description="the engine kind: one of gateway.engines.registry.ENGINES")
    url: str | None = None
    dns: str | None = Field(default=None, description="a DNS name whose addresses are this backend's replicas")
    port: int | None = Field(default=None, ge=1, le=65535, description="with dns: the replicas' port")
    scheme: Literal["http", "https"] = "http"
    models: list[str] | None = Field(default=None, description="served model ids; discovered when omitted")
    api_key: SecretStr | None = None
    api_key_env: str | None = Field(default=None, description="environment variable holding the API key")
    basic_auth: SecretStr | None = Field(
        default=None, description="user:password for HTTP Basic auth to the backend (a reverse proxy in front "
                                  "of the engine); also taken from user:password@ in url")
    max_concurrency: int | None = Field(default=None, gt=0)
    cache_ram_mib: int | None = Field(
        default=None, ge=-1, description="llama.cpp: the --cache-ram the server was started with (its default "
                                         "8192; 0 disables the host-RAM prompt cache, so only its slots hold "
                                         "prompts and the gateway models them slot by slot)")
    kv_events: KvEventsSettings | None = Field(
        default=None, description="vLLM, SGLang: follow the engine's KV-cache events (precise prefix routing): "
                                  "where it publishes them, or 'discover'")
    priority_scheduling: bool | Literal["lower-first", "higher-first"] = Field(
        default=False,
        description="vLLM, SGLang: the engine runs with priority scheduling (vLLM --scheduling-policy priority, "
                    "SGLang --enable-priority-scheduling), so each request carries its gateway priority in the "
                    "engine's 'priority' field; true: the engine's default order (vLLM lower values first, SGLang "
                    "higher first), or say which (SGLang with --schedule-low-priority-values-first: lower-first)")

    @model_validator(mode="before")
    @classmethod
    def _discover(cls, data: Any) -> Any:
        """``kv_events: discover`` is ``kv_events: {discover: true}``."""
        if isinstance(data, dict) and data.get("kv_events") == "discover":
            return {**data, "kv_events": {"discover": True}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _userinfo(cls, data: Any) -> Any:
        """Credentials in the URL move to ``basic_auth``, so the URL the gateway logs, traces and names in
        errors carries none (and the HTTP client is never asked to combine them with a key)."""
        if not isinstance(data, dict) or not isinstance(data.get("url"), str):
            return data
        parts = urlsplit(data["url"])
        if "@" not in parts.netloc:
            return data
        userinfo, _, hostport = parts.netloc.rpartition("@")
        if data.get("api_key") is not None or data.get("api_key_env") is not None:
            raise ValueError("url carries credentials (user:password@) and an api_key is set too: use one")
        if data.get("basic_auth") is not None:
            raise ValueError("url carries credentials (user:password@) and basic_auth is set too: use one")
        user, _, password = userinfo.partition(":")
        return {**data, "url": urlunsplit(parts._replace(netloc=hostport)),
                "basic_auth": f"{unquote(user)}:{unquote(password)}"}

    @field_validator("engine")
    @classmethod
    def _engine(cls, value: str) -> str:
        # the engine list is the registry's (read when a configuration is loaded, not when this module is)
        from gateway.engines.registry import ENGINES

        if value not in ENGINES:
            raise ValueError(f"unknown engine {value!r}; known: {', '.join(ENGINES)}")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        parts = urlsplit(value)
        if not parts.hostname:
            raise ValueError("has no host")
        try:
            port = parts.port  # (a port urlsplit cannot read raised later, in the middle of a reload)
        except ValueError:
            raise ValueError("has a port that is not a number from 1 to 65535") from None
        if port == 0:
            raise ValueError("has a port that is not a number from 1 to 65535")
        return value.rstrip("/")

    def priority_order(self) -> Literal["lower-first", "higher-first"] | None:
        """How the engine orders its queue by the ``priority`` field (None: the gateway sends none)."""
        if self.priority_scheduling is False:
            return None
        if self.priority_scheduling is True:
            from gateway.engines.registry import ENGINES

            return ENGINES[self.engine].priority_order
        return self.priority_scheduling

    @model_validator(mode="after")
    def _key_source(self) -> BackendSettings:
        if self.priority_scheduling is not False:
            from gateway.engines.registry import ENGINES

            if ENGINES[self.engine].priority_order is None:
                raise ValueError(f"priority_scheduling: engine {self.engine} does not schedule by a request priority")
        if self.cache_ram_mib is not None:
            from gateway.engines.registry import ENGINES

            if ENGINES[self.engine].cache != "slots":
                raise ValueError(f"cache_ram_mib is llama.cpp's --cache-ram; engine {self.engine} has no such option")
        if self.kv_events is not None:
            from gateway.engines.registry import ENGINES

            if not ENGINES[self.engine].kv_events:
                raise ValueError(f"kv_events: engine {self.engine} publishes no KV-cache events")
        if (self.url is None) == (self.dns is None):
            raise ValueError("set either url or dns (with port)")
        if self.dns is not None and self.port is None:
            raise ValueError("dns needs a port")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("set api_key or api_key_env, not both")
        if self.basic_auth is not None and (self.api_key is not None or self.api_key_env is not None):
            raise ValueError("set basic_auth or an api_key, not both")
        if self.basic_auth is not None and ":" not in self.basic_auth.get_secret_value():
            raise ValueError("basic_auth must be user:password")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env: environment variable {self.api_key_env} is not set")
        return self

    def resolved_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env is not None:
            return os.environ[self.api_key_env]
        return None

    def basic_auth_header(self) -> dict[str, str]:
        if self.basic_auth is None:
            return {}
        token = base64.b64encode(self.basic_auth.get_secret_value().encode()).decode()
        return {"Authorization": f"Basic {token}"}

    def secrets(self) -> list[str]:
        """What must never reach a client: the key, the Basic credentials and their encoded form (the header's
        value, and its bare base64 token with and without padding: an engine may echo either)."""
        found = [self.resolved_api_key()]
        if self.basic_auth is not None:
            header = self.basic_auth_header()["Authorization"]
            token = header.removeprefix("Basic ")
            found += [self.basic_auth.get_secret_value(), header, token, token.rstrip("=")]
            found.append(self.basic_auth.get_secret_value().partition(":")[2])
        return [s for s in found if s]


DEFAULT_FILTERS: tuple[str | PluginSettings, ...] = ("serves-model", "structured-output", "healthy",
                                                     "fits-context", "below-max-concurrency")


class PluginSettings(_Strict):
    """One plugin in a profile: its registered name, its weight (scorers only) and its own parameters."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str
    weight: float = Field(default=1.0, ge=0)

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ProfileSettings(_Strict):
    """A routing profile assembled from registered plugins."""

    filters: list[str | PluginSettings] = Field(default_factory=lambda: list(DEFAULT_FILTERS))
    scorers: list[PluginSettings] = Field(default_factory=list)
    picker: str | PluginSettings = "max-score"


# request headers that carry a client's credentials, and words that say a header does
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key", "api-key"})
# (and, sweeps 27-28, the names other gateways and proxies give theirs: x-litellm-key, x-pass, x-jwt, x-hmac,
# x-amzn-oidc-data, x-ms-client-principal)
CREDENTIAL_WORDS = ("auth", "cookie", "api-key", "apikey", "api_key", "token", "secret", "pass", "pwd", "key",
                    "credential", "jwt", "bearer", "cert", "sig", "hmac", "otp", "psk", "oidc", "principal")


class RoutingSettings(_Strict):
    policy: str = Field(default="default", description="a built-in policy or a profile defined under profiles")
    profiles: dict[str, ProfileSettings] = Field(default_factory=dict)
    session_header: str = Field(default="x-session-id", description="request header naming a session")
    engine_profile: Path | None = Field(default=None, description="profile file written by `gateway profile`")
    tokenizers: dict[str, Path] = Field(
        default_factory=dict, description="model id -> its Hugging Face tokenizer directory (tokenizer.json, "
                                          "tokenizer_config.json): the prompt as the engine's token ids, for the "
                                          "precise-prefix scorer on backends with kv_events")
    tokenize_max_chars: int = Field(default=64 * 1024, ge=1024,
                                    description="route on at most this many characters of a prompt's text")

    @field_validator("session_header")
    @classmethod
    def _not_a_credential(cls, value: str) -> str:
        # a session's name is kept in the session tables, published to every replica through Redis and may be
        # logged: a header that carries a client's credentials would put them there
        name = value.strip().lower()
        if name in CREDENTIAL_HEADERS or any(word in name for word in CREDENTIAL_WORDS):
            raise ValueError(f"{value!r} carries credentials: a session header's values are kept, shared with "
                             "every replica and may be logged; name a header of its own (x-session-id)")
        return value

    @field_validator("tokenizers")
    @classmethod
    def _tokenizer_dirs(cls, value: dict[str, Path]) -> dict[str, Path]:
        for model, directory in value.items():
            if not (directory / "tokenizer.json").is_file():
                raise ValueError(f"{model}: {directory} has no tokenizer.json")
        return value


class TimeoutSettings(_Strict):
    """Upstream timeouts in seconds."""

    connect: float = Field(default=5.0, gt=0)
    first_byte: float = Field(default=120.0, gt=0, description="request sent -> response headers")
    idle: float = Field(default=60.0, gt=0, description="longest gap between streamed chunks")
    total: float = Field(default=900.0, gt=0)


class DiscoverySettings(_Strict):
    interval: float = Field(default=10.0, gt=0, description="seconds between DNS re-resolutions")


class ScrapeSettings(_Strict):
    """The background loop that reads each backend's health, load and models."""

    interval: float = Field(default=1.0, gt=0)
    timeout: float = Field(default=2.0, gt=0)
    stale_after: float = Field(default=5.0, gt=0, description="older load readings are not trusted")
    models_every: int = Field(default=30, ge=1, description="re-discover models every N scrapes")


class StallGuardSettings(_Strict):
    """What the gateway does when the one loop an engine runs every request on (llama.cpp's) slows while requests
    with a constraint or tools (a grammar it follows token by token) run there: the static checks of grammars and
    schemas bound what they know, and this bounds what they miss (docs/security.md)."""

    enabled: bool = Field(default=True, description="stop such requests when the loop stalls, and keep the key's "
                                                    "off; turned off by a reload, its strikes are forgotten")
    stall_seconds: float = Field(
        default=1.0, gt=0, description="a load reading that waits this much longer than the health check before it "
                                       "(the loop's step) is a stall; raise it where a step is that slow anyway "
                                       "(a large model on CPUs)")
    stall_factor: float = Field(
        default=8.0, ge=1, description="so is one this many times the loop's usual (the 90th percentile of its "
                                       "recent readings while it worked for requests without a grammar), from "
                                       "0.1 s")
    strike_seconds: float = Field(
        default=600.0, gt=0, description="how long the key whose request stalled it has its requests with a "
                                         "grammar kept from such engines (with no keys: that grammar); doubled at "
                                         "each repeat, to a day")
    measure_alone: bool = Field(
        default=True, description="until a loop's usual is learnt, measure its step alone: an idle engine is sent a "
                                  "few tokens of a plain request, at most every 5 minutes (off: stall_seconds is "
                                  "the threshold until then)")


class StructuredOutputSettings(_Strict):
    """Checking non-streamed JSON answers against the request's schema (json_object: that it is JSON)."""

    validate_outputs: Literal["off", "mark", "retry"] = Field(
        default="off", description="mark: header + metric; retry: once on another backend, then mark"
    )
    models: dict[str, Literal["off", "mark", "retry"]] = Field(
        default_factory=dict, description="per-model override of validate_outputs"
    )
    stall_guard: StallGuardSettings = Field(default_factory=StallGuardSettings)

    @field_validator("validate_outputs", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @field_validator("models", mode="before")
    @classmethod
    def _yaml_offs(cls, value: object) -> object:
        if isinstance(value, dict):
            return {k: "off" if v is False else v for k, v in value.items()}
        return value

    def mode(self, model: str) -> str:
        return self.models.get(model, self.validate_outputs)


class StateSettings(_Strict):
    """Where several gateway processes and replicas share their limits and routing state: a Redis (or Valkey)
    server. Without ``url`` each process keeps its own."""

    url: str | None = Field(default=None, pattern=r"^(redis|rediss|unix)://",
                            description="redis://host:6379/0, rediss:// (TLS) or unix:///path.sock")
    prefix: str = Field(default="gateway:", min_length=1, description="prefix of every key (gateways sharing a Redis)")
    on_failure: Literal["open", "closed"] = Field(
        default="open", description="while Redis cannot be reached, limited keys pass (open) or get 503 (closed)")
    timeout_ms: float = Field(default=250.0, gt=0,
                              description="one Redis operation at most: past it the request's limits fail as "
                                          "on_failure says (a heartbeat past it takes the state down)")
    heartbeat_seconds: float = Field(default=1.0, gt=0, description="how often a replica renews its presence")
    replica_ttl_seconds: float = Field(
        default=10.0, gt=0, description="a replica silent this long is gone: its slots are freed for the others")
    secret_env: str | None = Field(
        default=None, description="environment variable holding the secret every replica seals its messages to the "
                                  "others with (the same for all); default: derived from the Redis password and the "
                                  "API keys' digests")

    @field_validator("url")
    @classmethod
    def _url_parses(cls, url: str | None) -> str | None:
        # (as Redis's client reads it, at start-up: a raw '[' in a password passed check-config and then stopped
        # `gateway serve` with "Invalid IPv6 URL", naming no field, sweep 24)
        if url is not None and not url.startswith("unix://"):
            try:
                urlsplit(url).port  # noqa: B018  (reading it is the check)
            except ValueError as exc:
                raise ValueError(f"not a URL Redis's client can read ({exc}); percent-encode any '[', ']', '@', "
                                 "':' or '/' in the password (%5B, %5D, %40, %3A, %2F)") from None
        if url is not None:
            # (a query parameter the client does not know passed, and every worker then exited on its first
            # connection, started again and again, sweep 30: the client's connection is built here, unconnected)
            from redis.asyncio import ConnectionPool

            try:
                ConnectionPool.from_url(url).make_connection()  # type: ignore[no-untyped-call]
            except (TypeError, ValueError) as exc:
                said = str(exc).replace("AbstractConnection.__init__() got an ", "")
                raise ValueError(f"Redis's client does not take this URL: {said[:200]}") from None
        return url

    @model_validator(mode="after")
    def _secret_set(self) -> StateSettings:
        if self.secret_env is not None and not os.environ.get(self.secret_env):
            raise ValueError(f"secret_env: environment variable {self.secret_env} is not set")
        return self


class AccessLogSettings(_Strict):
    """One JSON line per request on standard output (request id, model, backend, status, TTFT, tokens,
    duration); never a prompt, an answer or a key."""

    enabled: bool = True


class ModelTarget(_Strict):
    model: str = Field(min_length=1, description="a model the backends serve")
    weight: float = Field(default=1.0, gt=0, description="its share of the name's requests (90 and 10: a canary)")


class ModelSettings(_Strict):
    """A name clients use: an alias of one or more served models (a traffic split), and what to try when none
    of its backends can serve."""

    targets: list[ModelTarget] = Field(
        default_factory=list, max_length=16,
        description="the served models requests for this name go to, by weight, each session always to the same "
                    "one; empty: the name is itself a served model")
    fallbacks: list[str] = Field(
        default_factory=list, max_length=4,
        description="models (or aliases) tried in order when no backend can serve this one: all down, all full "
                    "past the queue's deadline, the prompt past every backend's context (their own fallbacks "
                    "are not followed)")


ADMIN_ON_NETWORK = (
    "server.admin_host: the admin listener on {host} can be reached from other machines, and no API key has the "
    "'admin' scope, so it would ask none: anyone reaching it could drain, reconfigure and reload the gateway; add a "
    "key with scopes: [admin], or keep admin_host on loopback (127.0.0.1, reached from afar with ssh -L)")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    server: ServerSettings = ServerSettings()
    backends: list[BackendSettings] = Field(default_factory=list)
    routing: RoutingSettings = RoutingSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    scrape: ScrapeSettings = ScrapeSettings()
    discovery: DiscoverySettings = DiscoverySettings()
    structured_output: StructuredOutputSettings = StructuredOutputSettings()
    access_log: AccessLogSettings = AccessLogSettings()
    limits: LimitSettings = LimitSettings()
    responses: ResponsesSettings = ResponsesSettings()
    retries: RetrySettings = RetrySettings()
    breaker: BreakerSettings = BreakerSettings()
    admission: AdmissionSettings = AdmissionSettings()
    auth: AuthSettings = AuthSettings()
    state: StateSettings = StateSettings()
    models: dict[str, ModelSettings] = Field(default_factory=dict, description="aliases, splits and fallbacks")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML document arrives as init kwargs; the environment overrides it.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _aliases_name_served_models(self) -> Settings:
        split = {name for name, m in self.models.items() if m.targets}
        for name, model in self.models.items():
            for target in model.targets:
                if target.model != name and target.model in split:
                    raise ValueError(f"models.{name}: target {target.model!r} is itself an alias with targets; "
                                     "name the served models")
        return self

    @model_validator(mode="after")
    def _workers_share_state(self) -> Settings:
        if self.server.workers != 1 and self.server.worker_count() > 1:
            if self.state.url is None:
                raise ValueError(
                    "server.workers: more than one worker needs state.url (a Redis or Valkey server): each worker "
                    "is a process of its own, and rate limits, max_concurrency slots, sessions and stored "
                    "responses kept in one process's memory would hold per worker, not per gateway")
            if self.server.port == 0:
                raise ValueError("server.workers: more than one worker needs a fixed server.port (0 would give "
                                 "each worker a port of its own)")
        return self

    @model_validator(mode="after")
    def _admin_listener_keyed(self) -> Settings:
        if self.server.admin_on_network() and not self.auth.has_admin_key():
            raise ValueError(ADMIN_ON_NETWORK.format(host=self.server.admin_host))
        return self

    @model_validator(mode="after")
    def _key_priorities(self) -> Settings:
        for key in self.auth.keys:
            own = self.admission.priority_of(key.priority if key.priority is not None
                                             else self.admission.default_priority, f"auth.keys ({key.name}).priority")
            if key.max_priority is not None:
                ceiling = self.admission.priority_of(key.max_priority, f"auth.keys ({key.name}).max_priority")
                if ceiling < own:
                    raise ValueError(f"auth.keys ({key.name}).max_priority is below its priority")
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> Settings:
        seen: set[str] = set()
        for backend in self.backends:
            if backend.name in seen:
                raise ValueError(f"backends: duplicate backend name {backend.name!r}")
            seen.add(backend.name)
        return self


def _field_path(loc: tuple[int | str, ...], raw: dict[str, Any]) -> str:
    parts: list[str] = []
    node: Any = raw
    for item in loc:
        if isinstance(item, int):
            label = f"[{item}]"
            if isinstance(node, list) and item < len(node):
                node = node[item]
                if isinstance(node, dict) and isinstance(node.get("name"), str):
                    label += f" ({node['name']})"
            else:
                node = None
            parts.append(label)
        else:
            parts.append(("." if parts else "") + item)
            node = node.get(item) if isinstance(node, dict) else None
    return "".join(parts) or "(top level)"


def settings_from_mapping(raw: dict[str, Any], source: str = "configuration") -> Settings:
    try:
        return Settings(**raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(part for part in err["loc"] if part not in ("function-after",))
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {_field_path(loc, raw)}: {msg}")
        raise ConfigError(f"{source} is invalid:\n" + "\n".join(lines)) from None


def read_settings_file(path: str | Path) -> bytes:
    """The configuration file's bytes, read once: a regular file, bounded (ConfigError when it cannot be read;
    :func:`gateway.config_file.read_config_file`)."""
    return read_config_file(path)


def read_settings_to_start(path: str | Path) -> bytes:
    """The configuration file's bytes as a gateway starts from them: read once it has held still
    (:func:`gateway.config_file.read_config_settled`)."""
    return read_config_settled(path)


def parse_settings(content: bytes, source: str) -> Settings:
    """Validate a configuration file's ``content`` (environment overrides applied); ``source`` names it in
    errors. Refused besides what the schema refuses: a mapping key written twice, an empty document (nothing,
    or only comments and blank lines: what a file being rewritten in place reads as at first, never a
    configuration; ``{}`` says "every default" on purpose), and a document whose end looks cut short
    (:mod:`gateway.config_file`)."""
    document = read_yaml(content, source)
    raw = document.data
    if raw is None:
        raise ConfigError(f"{source} is empty (nothing but comments or blank lines): a file being written, or "
                          "emptied by mistake, is no configuration (for every default, write {})")
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping (server:, backends:, routing:, ...)")
    if document.cut is not None:
        raise ConfigError(f"{source} {document.cut}")
    settings = settings_from_mapping(raw, source)
    if "auth" in raw and not settings.auth.keys and not settings.auth.open:
        # (an auth section whose key list came out empty is what a template whose list of secrets is missing
        # leaves, or a file cut inside it: a reload refused it, and a start from it served anyone, sweep 30)
        raise ConfigError(f"{source}: auth: the file's auth section lists no API keys: it may have been written or "
                          "read without them; to serve without keys on purpose, say auth: {open: true} (or leave the "
                          "auth section out)")
    return settings


def load_settings(path: str | Path) -> Settings:
    """Read and validate a YAML configuration file (environment overrides applied)."""
    return parse_settings(read_settings_file(path), str(path))
