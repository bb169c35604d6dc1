"""A gateway in front of an engine that answers garbage on its control plane (a raw scripted backend): the
security sweep's findings on the gateway -> engine boundary, end to end."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx

from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over

NAN = b"vllm:num_requests_running NaN\nvllm:num_requests_waiting -1e308\nvllm:kv_cache_usage_perc NaN\n"


def until(check: Callable[[], bool], what: str, within: float = 20.0) -> None:
    """Wait for a state change the scrape loop (every 0.1 s here) brings about."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"still not: {what}"
        time.sleep(0.05)


def test_a_backend_whose_load_turns_to_nan_and_then_goes_down_is_marked_down() -> None:
    with ScriptedUpstream() as upstream:
        upstream.get_answers["/metrics"] = (200, b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")
        _app, server = gateway_over(upstream, backend={"engine": "vllm"})
        with server as gw:
            assert httpx.get(gw.url + "/ready").json()["backends"]["scripted"]["routable"] is True
            upstream.get_answers["/metrics"] = (200, NAN)
            seen = upstream.gets.get("/metrics", 0)
            until(lambda: upstream.gets.get("/metrics", 0) >= seen + 3, "the NaN load read three times")
            ready = httpx.get(gw.url + "/ready")
            assert ready.status_code == 200 and ready.json()["backends"]["scripted"]["routable"] is True
            errors = re.search(r'gateway_backend_scrape_errors_total\{backend="scripted",engine="vllm"\} (\S+)',
                               httpx.get(gw.url + "/metrics").text)
            assert errors is not None and float(errors[1]) >= 3, "each garbage reading is counted"

            upstream.get_answers["/health"] = (503, b'{"error": "engine dead"}')
            until(lambda: httpx.get(gw.url + "/ready").status_code == 503, "/ready says not ready")
            assert httpx.get(gw.url + "/ready").json()["backends"]["scripted"]["health"] == "down"
            r = httpx.post(gw.url + "/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503, r.text


def test_a_gateway_starts_in_front_of_an_engine_reporting_nan_load() -> None:
    with ScriptedUpstream() as upstream:
        upstream.get_answers["/metrics"] = (200, NAN)
        _app, server = gateway_over(upstream, backend={"engine": "vllm"})
        with server as gw:
            assert httpx.get(gw.url + "/ready").status_code == 200
            r = httpx.post(gw.url + "/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
            assert r.status_code == 200 and "data: [DONE]" in r.text
