"""kv_events and routing.tokenizers in the configuration: what is accepted, what is refused and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, KvEventsSettings, settings_from_mapping

pytestmark = pytest.mark.unit


def backend(engine: str, **kv: object) -> dict[str, object]:
    return {"backends": [{"name": "b", "engine": engine, "url": "http://10.0.0.7:8000", "kv_events": kv}]}


def test_ports_take_the_backends_host_and_endpoints_are_used_as_given() -> None:
    s = settings_from_mapping(backend("vllm", port=5557, replay_port=5558, topic="kv@b"))
    kv = s.backends[0].kv_events
    assert kv is not None and kv.addresses("http://10.0.0.7:8000") == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    assert KvEventsSettings(endpoint="tcp://h:1").addresses("http://[::1]:80") == ("tcp://h:1", None)
    assert KvEventsSettings(port=9).addresses("http://[::1]:80") == ("tcp://[::1]:9", None)
    settings_from_mapping(backend("sglang", endpoint="tcp://10.0.0.7:5557"))


@pytest.mark.parametrize(("engine", "kv", "message"), [
    ("llamacpp", {"port": 5557}, "publishes no KV-cache events"),
    ("tabbyapi", {"port": 5557}, "publishes no KV-cache events"),
    ("vllm", {}, "either endpoint or port"),
    ("vllm", {"port": 1, "endpoint": "tcp://h:1"}, "either endpoint or port"),
    ("vllm", {"endpoint": "tcp://*:5557"}, "the address to connect to"),
    ("vllm", {"endpoint": "http://h:5557"}, "the address to connect to"),
    ("vllm", {"port": 1, "replay_port": 2, "replay_endpoint": "tcp://h:2"}, "replay_endpoint or replay_port"),
])
def test_refused_with_a_reason(engine: str, kv: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings_from_mapping(backend(engine, **kv))


def test_a_tokenizer_directory_must_hold_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has no tokenizer"):
        settings_from_mapping({"routing": {"tokenizers": {"m": str(tmp_path)}}})
    (tmp_path / "tokenizer.json").write_text("{}")
    assert settings_from_mapping({"routing": {"tokenizers": {"m": str(tmp_path)}}}).routing.tokenizers == {
        "m": tmp_path}
