"""The overhead benchmark's parts: its backend's protocol, the gateway configuration it writes, its table rows."""

from __future__ import annotations

import httpx
import yaml

from gateway.bench.overhead import gateway_yaml, level_row
from gateway.config import settings_from_mapping
from tests.bench.conftest import RawBackendThread


def test_raw_backend_streams_usage_only_when_asked_and_answers_plain_requests(raw_backend: RawBackendThread) -> None:
    body = {"model": "bench-model", "messages": [], "stream": True, "max_tokens": 3}
    with_usage = httpx.post(raw_backend.url + "/v1/chat/completions",
                            json={**body, "stream_options": {"include_usage": True}}).text
    without = httpx.post(raw_backend.url + "/v1/completions", json=body).text
    assert with_usage.count('"content":" tok"') == 3 and '"completion_tokens":3' in with_usage
    assert without.count('"text":" tok"') == 3 and '"usage"' not in without
    assert with_usage.endswith("data: [DONE]\n\n") and without.endswith("data: [DONE]\n\n")
    plain = httpx.post(raw_backend.url + "/v1/chat/completions", json={**body, "stream": False}).json()
    assert plain["usage"]["completion_tokens"] == 3
    assert httpx.get(raw_backend.url + "/v1/models").json()["data"][0]["id"] == "bench-model"
    assert httpx.post(raw_backend.url + "/v1/chat/completions", content=b"{").status_code == 400


def test_gateway_config_is_valid() -> None:
    settings = settings_from_mapping(yaml.safe_load(gateway_yaml("http://127.0.0.1:1", 2)))
    assert settings.backends[0].engine == "openai" and settings.server.port == 2


def test_level_row_adds_against_direct() -> None:
    def target(ttft: float, itl: float) -> dict[str, object]:
        m = {"ttfb_s": {"p50": ttft}, "ttft_s": {"p50": ttft, "p99": 2 * ttft}, "itl_s": {"mean": itl, "p99": itl}}
        return {"ok": 1, "requests": 1, "errors": 0, "metrics": m, "chunks_per_s": 10.0,
                "cpu_ms_per_request": 1.0, "cpu_us_per_chunk": 2.0}

    row = level_row({"targets": {"direct": target(0.001, 0.005), "gw": target(0.003, 0.0051)}}, "direct")
    assert "added_ttft_ms_p50" not in row["direct"]
    assert abs(row["gw"]["added_ttft_ms_p50"] - 2.0) < 1e-9 and abs(row["gw"]["added_ttft_ms_p99"] - 4.0) < 1e-9
    assert abs(row["gw"]["added_itl_ms_mean"] - 0.1) < 1e-9
