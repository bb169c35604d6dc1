"""(c) ``gateway bench routing real-prefix``: prefix vs round-robin on real llama-server processes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.client import Target
from gateway.bench.procs import get_json
from gateway.bench.report import build_report
from gateway.bench.routing.oracle import OracleResult, llamacpp_oracle
from gateway.bench.routing.prefix import (
    summarize_prefix,
)
from gateway.bench.routing.stack import (
    REAL_POLICIES,
    Log,
    PortPool,
    Stack,
    phase_note,
    run_interleaved,
)
from gateway.bench.runner import (
    Arrival,
    host_busy_share,
    host_cpu_times,
    run_sync,
)
from gateway.bench.workload import BenchRequest, WorkloadConfig, build_workload


@dataclass
class RealPrefixConfig:
    policies: list[str] = field(default_factory=lambda: list(REAL_POLICIES))
    servers: int = 3
    slots: int = 2
    ctx: int = 4096  # per slot
    threads: int = 1
    groups: int = 6  # each server's slots hold about a third of them
    prompts_per_group: int = 8
    system_len: int = 500  # words; the generated model's tokenizer makes ~2.9 tokens of each: ~1,450 tokens
    question_len: int = 16
    output_len: int = 8
    concurrency: int = 3
    round_size: int = 16
    count: int | None = None
    scrape_interval: float = 0.5
    seed: int = 0
    base_port: int = 18800
    profiles: dict[str, Any] = field(default_factory=dict)
    out: Path = Path("reports/routing")
    include_requests: bool = True


def real_workload(cfg: RealPrefixConfig) -> WorkloadConfig:
    return WorkloadConfig(kind="shared-prefix", count=cfg.count, seed=cfg.seed, output_len=cfg.output_len,
                          ignore_eos=True, groups=cfg.groups, prompts_per_group=cfg.prompts_per_group,
                          system_len=cfg.system_len, question_len=cfg.question_len)


def run_real_prefix(cfg: RealPrefixConfig, log: Log = print) -> dict[str, Any]:
    from gateway.llamacpp.build import build
    from gateway.llamacpp.model import model_path
    from gateway.llamacpp.server import LlamaServer

    binary = build(quiet=True)
    model = model_path("large")
    requests = build_workload(real_workload(cfg))
    workdir = cfg.out / "real-prefix"
    workdir.mkdir(parents=True, exist_ok=True)
    ports = PortPool(cfg.base_port)
    stack = Stack(workdir, log, cfg.scrape_interval, cfg.profiles)
    log(f"real-prefix: {len(requests)} requests x {len(cfg.policies)} policies; {cfg.servers} llama-server "
        f"({cfg.slots} slots, {cfg.threads} thread) per policy; {cfg.groups} groups")
    try:
        targets = []
        for policy in cfg.policies:
            backends = []
            for i in range(cfg.servers):
                server = LlamaServer(binary, model, ports.take(), slots=cfg.slots, ctx=cfg.ctx, threads=cfg.threads)
                stack.add_stopper(server.stop)
                server.start(timeout=120)
                backends.append((f"llama-{i}", "llamacpp", server.url))
            # the servers run without a host-RAM prompt cache (LlamaServer's default): say so, as an operator would
            targets.append(stack.gateway(policy, ports.take(), backends, policy, backend_options={"cache_ram_mib": 0}))
        model_id = _first_model(targets[0].url)
        targets = [Target(t.name, t.url, model_id, pid=t.pid) for t in targets]
        best = real_oracle(backends[0][2], requests, cfg)
        log(f"oracle hit rate {100 * (best.hit_rate or 0):.1f}% (unlimited caches: "
            f"{100 * (best.bound_hit_rate or 0):.1f}%)")
        log("all up; running (interleaved)")
        before = host_cpu_times()
        started = time.perf_counter()
        result = run_sync(run_interleaved(targets, requests, Arrival(concurrency=cfg.concurrency), cfg.round_size,
                                          request_timeout=300))
        elapsed = time.perf_counter() - started
        busy = host_busy_share(before, host_cpu_times())
    finally:
        stack.stop()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["model"] = str(model)
    bench = build_report(result, config, include_requests=cfg.include_requests)
    summary = summarize_prefix(bench, oracle=best, real=True)
    prompt = [s["prompt_tokens"] / s["ok"] for s in summary["policies"].values() if s["ok"] and s["prompt_tokens"]]
    return {"schema": "gateway-bench-routing/1", "benchmark": "real-prefix",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config, "host_busy_share": busy,
            "wall_s": elapsed, "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None, **summary,
            "bench": bench, **phase_note(result)}


def llama_prompt_tokens(url: str, requests: Sequence[BenchRequest]) -> list[list[int]]:
    """Each request's prompt tokens as the llama-server at ``url`` computes them for a chat completion: its
    chat template (``/apply-template``), then ``/tokenize`` with special tokens added and parsed."""
    import httpx
    import orjson

    seen: dict[bytes, list[int]] = {}
    out = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for r in requests:
            key = orjson.dumps(r.body["messages"])
            if key not in seen:
                applied = client.post("/apply-template", json={"messages": r.body["messages"]})
                applied.raise_for_status()
                tokens = client.post("/tokenize", json={"content": applied.json()["prompt"], "add_special": True,
                                                        "parse_special": True})
                tokens.raise_for_status()
                seen[key] = [int(t) for t in tokens.json()["tokens"]]
            out.append(seen[key])
    return out


def real_oracle(url: str, requests: Sequence[BenchRequest], cfg: RealPrefixConfig) -> OracleResult:
    """The oracle (see ``oracle.py``) over ``cfg.servers`` llama-servers of ``cfg.slots`` slots each."""
    return llamacpp_oracle(llama_prompt_tokens(url, requests), [r.output_len for r in requests], cfg.servers,
                           cfg.slots)


def _first_model(url: str) -> str:
    doc = get_json(url + "/v1/models")
    data = doc.get("data") if isinstance(doc, dict) else None
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(data[0]["id"])


# --- command line -----------------------------------------------------------------------------------------------
