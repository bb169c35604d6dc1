"""End to end: a gateway routing a shared-prefix workload to four emulated vLLM engines. With the ``prefix``
policy the engines serve more of the prompts from their prefix caches (as they report it in
``usage.prompt_tokens_details.cached_tokens``) than with ``round-robin``, and about as much as the oracle
placement of the prefix benchmarks finds for the same requests and caches."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import openai

from gateway.app import create_app
from gateway.bench.routing.oracle import vllm_emulator_oracle
from gateway.bench.workload import BenchRequest, WorkloadConfig, build_workload
from gateway.sim import FleetThread, SimSpec
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import Tokenizer
from tests.api.conftest import TIME_SCALE, gateway_settings
from tests.conftest import serve_in_thread
from tests.waiting import wait_until

BACKENDS = 4
KV_TOKENS = 8192  # every backend could hold every prefix: only placement decides what is reused
WORKLOAD = WorkloadConfig(kind="shared-prefix", groups=4, prompts_per_group=6, system_len=250, question_len=8,
                          output_len=2, seed=7)


def hit_rate(policy: str, requests: Sequence[BenchRequest]) -> float:
    """Cached / prompt tokens over ``requests`` sent one at a time through a fresh gateway and fresh engines."""
    specs = [SimSpec(engine="vllm", model="shared", name=f"v{i}", time_scale=TIME_SCALE,
                     overrides={"kv_capacity_tokens": KV_TOKENS}) for i in range(BACKENDS)]
    with FleetThread(specs) as fleet, \
            serve_in_thread(create_app(gateway_settings(fleet.fleet.servers, routing={"policy": policy}))) as gw:
        wait_until(lambda: ready(gw.url) == BACKENDS, f"the gateway sees its {BACKENDS} backends ready")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        cached = prompt = 0
        for r in requests:
            reply = client.chat.completions.create(model="shared", messages=r.body["messages"], max_tokens=2)
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            cached += reply.usage.prompt_tokens_details.cached_tokens or 0
            prompt += reply.usage.prompt_tokens
    return cached / prompt


def ready(url: str) -> int:
    """How many backends the gateway sees ready, with their models."""
    states = httpx.get(url + "/ready").json().get("backends", {}).values()
    return sum(1 for b in states if b.get("health") == "ready" and b.get("models"))


def test_prefix_policy_serves_more_from_the_engines_caches_than_round_robin() -> None:
    requests = build_workload(WORKLOAD)
    round_robin = hit_rate("round-robin", requests)
    prefix = hit_rate("prefix", requests)
    assert prefix > round_robin + 0.2, f"prefix {prefix:.2f} vs round-robin {round_robin:.2f}"

    tokenizer = Tokenizer()
    oracle = vllm_emulator_oracle([tokenizer.encode(render_chat(r.body["messages"])) for r in requests],
                                  [r.output_len for r in requests], BACKENDS, KV_TOKENS)
    assert oracle.hit_rate is not None
    assert prefix >= 0.9 * oracle.hit_rate, f"prefix {prefix:.2f} vs the oracle's {oracle.hit_rate:.2f}"
