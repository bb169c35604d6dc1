"""Settings: one YAML file plus ``GATEWAY_*`` environment overrides, validated by pydantic.

Environment variables win over the file and nest with ``__``: ``GATEWAY_SERVER__PORT=9000``,
``GATEWAY_ROUTING__POLICY=round-robin``, ``GATEWAY_TIMEOUTS__TOTAL=120``. A bad file raises
:class:`ConfigError` whose message names each offending field (``backends[1] (vllm-a).url: ...``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

EngineName = Literal["llamacpp", "vllm", "sglang", "tabbyapi", "openai"]


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the fields at fault."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0, description="larger request bodies get 413")
    shutdown_timeout: float = Field(default=30.0, ge=0, description="seconds in-flight streams get to finish")


class LimitSettings(_Strict):
    """Per-request limits; beyond them a 400 naming the field."""

    max_messages: int = Field(default=4096, gt=0)
    max_tokens: int = Field(default=131072, gt=0, description="largest max_tokens / max_completion_tokens accepted")


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


class AdmissionSettings(_Strict):
    """When every eligible backend is at its max_concurrency, requests wait here, fairly across API keys."""

    queue_size: int = Field(default=1024, ge=0, description="waiting requests at most; beyond them 429")
    max_wait_seconds: float = Field(default=30.0, ge=0)


class ApiKeySettings(_Strict):
    name: str = Field(min_length=1)
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$",
                                   description="hex SHA-256 of the key (the key itself is never stored)")
    key_env: str | None = Field(default=None, description="environment variable holding the key")
    models: list[str] = Field(default_factory=lambda: ["*"], description="allowed models (shell patterns)")
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)

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
    """Gateway API keys. With none configured, the gateway is open."""

    keys: list[ApiKeySettings] = Field(default_factory=list)
    protect_health: bool = Field(default=False, description="/health and /ready need a key too")
    protect_metrics: bool = Field(default=False, description="/metrics needs a key too")


class BackendSettings(_Strict):
    """One backend, or with ``dns`` a group of replicas: every address the name resolves to (a Kubernetes
    headless Service) becomes a backend ``<name>-<address>`` at ``scheme://address:port``, re-resolved every
    ``discovery.interval`` seconds."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
    engine: EngineName
    url: str | None = None
    dns: str | None = Field(default=None, description="a DNS name whose addresses are this backend's replicas")
    port: int | None = Field(default=None, ge=1, le=65535, description="with dns: the replicas' port")
    scheme: Literal["http", "https"] = "http"
    models: list[str] | None = Field(default=None, description="served model ids; discovered when omitted")
    api_key: SecretStr | None = None
    api_key_env: str | None = Field(default=None, description="environment variable holding the API key")
    max_concurrency: int | None = Field(default=None, gt=0)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _key_source(self) -> BackendSettings:
        if (self.url is None) == (self.dns is None):
            raise ValueError("set either url or dns (with port)")
        if self.dns is not None and self.port is None:
            raise ValueError("dns needs a port")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("set api_key or api_key_env, not both")
        if self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"api_key_env: environment variable {self.api_key_env} is not set")
        return self

    def resolved_api_key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env is not None:
            return os.environ[self.api_key_env]
        return None


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


class RoutingSettings(_Strict):
    policy: str = Field(default="default", description="a built-in policy or a profile defined under profiles")
    profiles: dict[str, ProfileSettings] = Field(default_factory=dict)
    session_header: str = Field(default="x-session-id", description="request header naming a session")
    engine_profile: Path | None = Field(default=None, description="profile file written by `gateway profile`")


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


class StructuredOutputSettings(_Strict):
    """Checking non-streamed JSON answers against the request's schema (json_object: that it is JSON)."""

    validate_outputs: Literal["off", "mark", "retry"] = Field(
        default="off", description="mark: header + metric; retry: once on another backend, then mark"
    )
    models: dict[str, Literal["off", "mark", "retry"]] = Field(
        default_factory=dict, description="per-model override of validate_outputs"
    )

    def mode(self, model: str) -> str:
        return self.models.get(model, self.validate_outputs)


class AccessLogSettings(_Strict):
    """One JSON line per request on standard output (request id, model, backend, status, TTFT, tokens,
    duration); never a prompt, an answer or a key."""

    enabled: bool = True


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
    retries: RetrySettings = RetrySettings()
    breaker: BreakerSettings = BreakerSettings()
    admission: AdmissionSettings = AdmissionSettings()
    auth: AuthSettings = AuthSettings()

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


def load_settings(path: str | Path) -> Settings:
    """Read and validate a YAML configuration file (environment overrides applied)."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read configuration {file}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file} is not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: the top level must be a mapping (server:, backends:, routing:, ...)")
    return settings_from_mapping(raw, str(file))
