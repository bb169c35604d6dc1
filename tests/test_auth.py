"""API keys: digests only, constant-time lookup, model permissions and per-key budgets."""

from __future__ import annotations

import hashlib

import pytest

from gateway.auth import Client, KeyStore, TokenBucket
from gateway.config import ApiKeySettings, AuthSettings, settings_from_mapping
from gateway.errors import GatewayError
from gateway.routing.cache_domain import SHARED, CacheDomain

pytestmark = pytest.mark.unit


def store(monkeypatch: pytest.MonkeyPatch) -> KeyStore:
    monkeypatch.setenv("TEAM_B_KEY", "sk-team-b")
    settings = settings_from_mapping({"auth": {"keys": [
        {"name": "a", "key_sha256": hashlib.sha256(b"sk-team-a").hexdigest(), "models": ["llama-*"],
         "requests_per_minute": 2},
        {"name": "b", "key_env": "TEAM_B_KEY", "tokens_per_minute": 600},
    ]}})
    return KeyStore(settings.auth)


def test_keys_by_digest_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = store(monkeypatch)
    assert keys.authenticate(b"Bearer sk-team-a", None).name == "a"  # type: ignore[union-attr]
    assert keys.authenticate(None, b"sk-team-b").name == "b"  # type: ignore[union-attr]
    for authorization, api_key, code in [(None, None, "missing_api_key"), (b"Bearer nope", None, "invalid_api_key"),
                                         (b"Basic c2stdGVhbS1h", None, "missing_api_key")]:
        with pytest.raises(GatewayError) as err:
            keys.authenticate(authorization, api_key)
        assert err.value.status == 401 and err.value.code == code


def test_models_and_request_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = store(monkeypatch)
    a = keys.authenticate(b"Bearer sk-team-a", None)
    assert a is not None
    with pytest.raises(GatewayError) as err:
        KeyStore.admit(a, "mistral-7b")
    assert err.value.status == 403 and err.value.param == "model"
    KeyStore.admit(a, "llama-3")
    KeyStore.admit(a, "llama-3")
    with pytest.raises(GatewayError) as err:
        KeyStore.admit(a, "llama-3")
    assert err.value.status == 429 and err.value.headers["retry-after"] == "30"


def test_token_budget_is_charged_with_real_usage() -> None:
    bucket = TokenBucket(600, now=0)  # 10 tokens/s
    assert bucket.take(0, now=0) == 0
    bucket.charge(700, now=0)  # one large request overdraws it
    assert bucket.take(0, now=5) == pytest.approx(5.0)  # -100 + 50 refilled: 5 s more to get above zero
    assert bucket.take(0, now=10.1) == 0


def test_key_settings_are_validated() -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match="set exactly one of key_sha256 or key_env"):
        settings_from_mapping({"auth": {"keys": [{"name": "x"}]}})
    with pytest.raises(ConfigError, match="key_sha256"):
        settings_from_mapping({"auth": {"keys": [{"name": "x", "key_sha256": "not-hex"}]}})


def test_max_in_flight_places_are_taken_and_given_back() -> None:
    key = ApiKeySettings(name="c", key_sha256="0" * 64, max_in_flight=2)
    client = Client("c", key, None, None)
    assert KeyStore.hold(client) and KeyStore.hold(client)
    with pytest.raises(GatewayError) as refused:
        KeyStore.hold(client)
    assert refused.value.status == 429 and refused.value.code == "concurrency_limit"
    assert refused.value.headers["retry-after"] == "1"
    KeyStore.release(client)
    assert KeyStore.hold(client)
    assert not KeyStore.hold(Client("u", ApiKeySettings(name="u", key_sha256="1" * 64), None, None))  # no cap


def test_routing_internals_are_explained_only_to_an_admin_key_that_asks() -> None:
    def client(*scopes: str) -> Client:
        return Client("k", ApiKeySettings(name="k", key_sha256="0" * 64, scopes=list(scopes)), None, None)

    admin, tenant = client("inference", "admin"), client("inference")
    assert KeyStore.explains_routing(admin, b"route")
    assert KeyStore.explains_routing(admin, b"timing, Route")
    assert not KeyStore.explains_routing(admin, None) and not KeyStore.explains_routing(admin, b"timing")
    assert not KeyStore.explains_routing(tenant, b"route")
    assert KeyStore.explains_routing(None, b"route")  # no keys configured: no tenants to keep apart


def test_each_key_is_a_cache_domain_of_its_own_unless_keys_share_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def domains(*keys: dict[str, object]) -> dict[str, object]:
        settings = settings_from_mapping({"auth": {"keys": [
            {"key_sha256": hashlib.sha256(str(k["name"]).encode()).hexdigest(), **k} for k in keys]}})
        return {name: client.cache_domain for name, client in
                ((c.name, c) for _, c in KeyStore(settings.auth)._clients)}

    one = domains({"name": "a"}, {"name": "ops", "scopes": ["admin", "metrics"]})
    assert one == {"a": SHARED, "ops": SHARED}, "one domain (a key that cannot infer owns none): nothing to isolate"
    together = domains({"name": "a", "cache_domain": "team"}, {"name": "b", "cache_domain": "team"})
    assert set(together.values()) == {SHARED}
    three = domains({"name": "a"}, {"name": "b", "cache_domain": "team"}, {"name": "c", "cache_domain": "team"})
    a, b, c = (three[n] for n in "abc")
    assert isinstance(a, CacheDomain) and isinstance(b, CacheDomain)
    assert a.name == "a" and b.name == c.name == "team" and b == c
    assert a.salt and b.salt and a.salt != b.salt and len(a.salt) == 64
    again = domains({"name": "a"}, {"name": "b", "cache_domain": "team"}, {"name": "c", "cache_domain": "team"})
    assert again == three, "every replica derives the same salts"
    monkeypatch.setenv("SALT_SECRET", "s3cret")
    settings = settings_from_mapping({"auth": {"cache_salt_env": "SALT_SECRET", "keys": [
        {"name": n, "key_sha256": hashlib.sha256(n.encode()).hexdigest()} for n in "ab"]}})
    keyed = {c.name: c.cache_domain.salt for _, c in KeyStore(settings.auth)._clients}
    assert keyed["a"] not in (None, a.salt) and keyed["a"] != keyed["b"]


def test_a_reload_that_lowers_a_limit_neither_refills_nor_forgives_the_budget() -> None:
    """Lowering a key's limit in process made it a new, full bucket: a key that had spent its requests or
    overdrawn its tokens was let in again at once."""
    def auth(rpm: int | None, tpm: int | None) -> AuthSettings:
        return settings_from_mapping({"auth": {"keys": [
            {"name": "a", "key_sha256": hashlib.sha256(b"sk-a").hexdigest(), "requests_per_minute": rpm,
             "tokens_per_minute": tpm}]}}).auth

    keys = KeyStore(auth(2, 6000))
    a = keys.authenticate(b"Bearer sk-a", None)
    assert a is not None
    KeyStore.admit(a, "m")
    KeyStore.admit(a, "m")  # both requests of the minute spent (one comes back every 30 s)
    for rpm, tpm in ((1, 6000), (60, 6000)):  # lowered, then raised: the spent budget stays spent
        keys.update(auth(rpm, tpm))
        with pytest.raises(GatewayError) as spent:
            KeyStore.admit(a, "m")
        assert spent.value.code == "rate_limit_requests"
    keys.update(auth(None, 6000))
    KeyStore.settle(a, KeyStore.admit(a, "m", reserve=100), 30_000)  # 24,000 tokens overdrawn
    keys.update(auth(None, 3000))  # (the debt is owed at 50 tokens/s now: 8 minutes)
    with pytest.raises(GatewayError) as owed:
        KeyStore.admit(a, "m", reserve=1)
    assert owed.value.code == "rate_limit_tokens" and float(owed.value.headers["retry-after"]) > 400
    keys.update(auth(None, None))  # a limit lifted is lifted
    assert KeyStore.admit(a, "m", reserve=1) == 0
