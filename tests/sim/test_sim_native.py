"""Native endpoints over raw HTTP (httpx), with each engine's real JSON shapes."""

from __future__ import annotations

import httpx

from gateway.sim import FleetThread


def get(fleet: FleetThread, engine: str, path: str) -> httpx.Response:
    with httpx.Client(timeout=10) as c:
        return c.get(fleet.fleet[f"sim-{engine}"].url + path)


def post(fleet: FleetThread, engine: str, path: str, body: object) -> httpx.Response:
    with httpx.Client(timeout=10) as c:
        return c.post(fleet.fleet[f"sim-{engine}"].url + path, json=body)


def test_llamacpp_native(fleet: FleetThread) -> None:
    assert get(fleet, "llamacpp", "/health").json() == {"status": "ok"}
    props = get(fleet, "llamacpp", "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 4096
    slots = get(fleet, "llamacpp", "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    for s in slots:
        assert {"n_ctx", "is_processing", "n_prompt_tokens", "n_prompt_tokens_cache"} <= set(s)
        assert set(s["next_token"][0]) >= {"has_next_token", "n_remain", "n_decoded"}
    toks = post(fleet, "llamacpp", "/tokenize", {"content": "Hello world"}).json()["tokens"]
    assert len(toks) == 2
    assert post(fleet, "llamacpp", "/detokenize", {"tokens": toks}).json() == {"content": "Hello world"}
    done = post(fleet, "llamacpp", "/completion", {"prompt": "abc", "n_predict": 2}).json()
    assert done["stop"] is True and done["tokens_predicted"] == 2 and done["timings"]["predicted_n"] == 2
    models = get(fleet, "llamacpp", "/v1/models").json()
    assert models["data"][0]["id"] == "sim-llama-2-7b" and models["data"][0]["owned_by"] == "llamacpp"
    missing = get(fleet, "llamacpp", "/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_vllm_native(fleet: FleetThread) -> None:
    for path in ("/health", "/ping"):
        r = get(fleet, "vllm", path)
        assert r.status_code == 200 and r.content == b""
    assert get(fleet, "vllm", "/version").json() == {"version": "0.33.0"}
    assert get(fleet, "vllm", "/load").json() == {"server_load": 0}
    tok = post(fleet, "vllm", "/tokenize", {"model": "sim-llama-2-7b", "prompt": "Hello world"}).json()
    assert tok["count"] == 3 and tok["max_model_len"] == 4096 and len(tok["tokens"]) == 3
    assert get(fleet, "vllm", "/v1/models").json()["data"][0]["max_model_len"] == 4096


def test_sglang_native(fleet: FleetThread) -> None:
    before = fleet.fleet["sim-sglang"].stats.completed
    r = get(fleet, "sglang", "/health")
    assert r.status_code == 200
    assert get(fleet, "sglang", "/health_generate").status_code == 200
    assert fleet.fleet["sim-sglang"].stats.completed == before + 2  # health runs a generation
    loads = get(fleet, "sglang", "/v1/loads").json()
    entry = loads["loads"][0]
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage",
            "cache_hit_rate"} <= set(entry)
    assert {"timestamp", "aggregate"} <= set(loads)
    info = get(fleet, "sglang", "/server_info").json()
    assert info["max_total_tokens"] == entry["max_total_num_tokens"]
    out = post(fleet, "sglang", "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4}}).json()
    assert out["meta_info"]["completion_tokens"] == 4 and len(out["output_ids"]) == 4
    assert {"prompt_tokens", "cached_tokens", "finish_reason"} <= set(out["meta_info"])
    flushed = post(fleet, "sglang", "/flush_cache", {})
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")


def test_tabbyapi_native(fleet: FleetThread) -> None:
    assert get(fleet, "tabbyapi", "/health").json() == {"status": "healthy", "issues": []}
    card = get(fleet, "tabbyapi", "/v1/model").json()
    assert card["id"] == "sim-llama-2-7b"
    assert {"max_seq_len", "max_batch_size", "cache_size"} <= set(card["parameters"])
    assert get(fleet, "tabbyapi", "/v1/model/list").json()["data"][0]["id"] == card["id"]
    props = get(fleet, "tabbyapi", "/props").json()
    assert props["total_slots"] == card["parameters"]["max_batch_size"]
    enc = post(fleet, "tabbyapi", "/v1/token/encode", {"text": "Hello world"}).json()
    assert enc["length"] == 3 == len(enc["tokens"])
    assert get(fleet, "tabbyapi", "/metrics").status_code == 404  # TabbyAPI has no metrics
