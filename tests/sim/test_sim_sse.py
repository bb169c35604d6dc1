"""SSE framing per engine over raw HTTP: line endings, comment pings, [DONE] rules, timings, in-stream errors."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from gateway.sim import FleetThread

BODY = {"model": "sim-llama-2-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


def events(raw: str, sep: str) -> list[str]:
    return [e for e in raw.split(sep + sep) if e]


def stream_raw(fleet: FleetThread, engine: str, body: dict[str, object] | None = None) -> str:
    url = fleet.fleet[f"sim-{engine}"].url
    with httpx.Client(timeout=10) as c:
        r = c.post(url + "/v1/chat/completions", json=body or BODY)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return r.text


def test_tabbyapi_lines_end_crlf_and_open_with_a_ping(fleet: FleetThread) -> None:
    raw = stream_raw(fleet, "tabbyapi")
    evs = events(raw, "\r\n")
    assert evs[0].startswith(": ping")
    assert evs[-1] == "data: [DONE]"
    assert "\n\n" not in raw.replace("\r\n", "")


@pytest.mark.parametrize("engine", ["llamacpp", "vllm", "sglang"])
def test_lf_framing_and_done(fleet: FleetThread, engine: str) -> None:
    raw = stream_raw(fleet, engine)
    assert "\r" not in raw
    evs = events(raw, "\n")
    assert evs[-1] == "data: [DONE]"
    assert evs[0].startswith(": ping") == (engine == "llamacpp")


def test_llamacpp_timings_on_the_last_chunk(fleet: FleetThread) -> None:
    for include_usage in (False, True):
        raw = stream_raw(fleet, "llamacpp", {**BODY, "stream_options": {"include_usage": include_usage}})
        datas = [json.loads(e[6:]) for e in events(raw, "\n") if e.startswith("data: {")]
        assert "timings" in datas[-1] and all("timings" not in d for d in datas[:-1])
        t = datas[-1]["timings"]
        assert {"cache_n", "prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"} <= set(t)
        assert t["predicted_n"] == 4
        assert 100 < t["predicted_per_second"] < 300  # ~186 tok/s single stream, reported in simulated time
        assert (datas[-1]["choices"] == []) == include_usage


@pytest.mark.parametrize(("engine", "done_after_error"),
                         [("llamacpp", False), ("vllm", True), ("sglang", True), ("tabbyapi", False)])
def test_in_stream_error_and_done_rule(fleet: FleetThread, engine: str, done_after_error: bool) -> None:
    server = fleet.fleet[f"sim-{engine}"]
    server.faults.error_mid_stream_after_tokens = 2
    try:
        raw = stream_raw(fleet, engine, {**BODY, "max_tokens": 10})
    finally:
        server.faults.error_mid_stream_after_tokens = None
    sep = "\r\n" if engine == "tabbyapi" else "\n"
    datas = [e[6:] for e in events(raw, sep) if e.startswith("data: ")]
    errors = [json.loads(d) for d in datas if d.startswith("{") and "error" in json.loads(d)]
    assert len(errors) == 1 and "message" in errors[0]["error"]
    assert (datas[-1] == "[DONE]") == done_after_error
    assert not any('"finish_reason":"' in d for d in datas)


def test_native_llamacpp_completion_stream_has_no_done(fleet: FleetThread) -> None:
    url = fleet.fleet["sim-llamacpp"].url
    with httpx.Client(timeout=10) as c:
        raw = c.post(url + "/completion", json={"prompt": "Hello", "n_predict": 3, "stream": True}).text
    datas = [json.loads(e[6:]) for e in events(raw, "\n") if e.startswith("data: ")]
    assert [d["stop"] for d in datas] == [False, False, False, True]
    assert datas[-1]["tokens_predicted"] == 3 and "timings" in datas[-1] and datas[-1]["stop_type"] == "limit"


def test_native_sglang_generate_stream_is_cumulative(fleet: FleetThread) -> None:
    url = fleet.fleet["sim-sglang"].url
    with httpx.Client(timeout=10) as c:
        raw = c.post(url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 3},
                                              "stream": True}).text
    evs = events(raw, "\n")
    assert evs[-1] == "data: [DONE]"
    datas = [json.loads(e[6:]) for e in evs[:-1]]
    texts = [d["text"] for d in datas]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts)) and len(texts) == 3
    assert datas[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert datas[-1]["meta_info"]["completion_tokens"] == 3
