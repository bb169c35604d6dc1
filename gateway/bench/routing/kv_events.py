"""(e) ``gateway bench routing kv-events``: prefix routing on the engines' own KV events (precise) against
the gateway's guess (approximate), round-robin and the oracle, on emulated vLLM servers that publish their
events and tokenize with a real tokenizer file.

Workloads (same requests for every policy, interleaved rounds):

* ``eviction``: Zipf-popular groups (s = 1.1) of shared system prompts whose set is at least 4x one backend's
  prefix cache (``cache_share`` 0.2 of the set per backend), so caches evict all the time;
* ``uniform``: the ``prefix`` benchmark's workload (every group as often, caches a third of the set each);
* ``replicated``: the eviction workload through two gateway replicas per policy taking requests in turn (a
  round-robin load balancer): each replica's approximate index sees half of what the engines cache, while
  every replica reads the same events.

Per workload: cache-hit rate (the engines' own cached-token counts), TTFT p50/p90, tokens/s, the oracle's hit
rate for the same sequence and cache sizes (``oracle.py``), and the targets: precise reaches 95% of the
oracle's hit rate on the eviction workload, and is never below approximate's hit rate on any workload.

Then ``replicas``: two gateway routers in this process, each with its own subscribers to the same engines'
events, route the same request stream (see :mod:`gateway.bench.routing.replicas`): the share of requests on
which they decide alike (target 99%).

The tokenizer's cost per request (cold, and with its segment cache warm) is measured on the workload's
prompts and on one prompt of ``tokenize_max_chars``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.client import Target
from gateway.bench.report import build_report
from gateway.bench.routing.oracle import OracleResult, hit_rate_of_oracle, vllm_emulator_oracle
from gateway.bench.routing.stack import (
    HOST,
    SIM_MODEL,
    Log,
    PortPool,
    Stack,
    against,
    gateway_config,
    phase_note,
    policy_summary,
    run_interleaved,
    sim_server,
    target_check,
)
from gateway.bench.runner import Arrival, host_busy_share, host_cpu_times, run_sync
from gateway.bench.workload import BenchRequest, WorkloadConfig, build_workload

KV_POLICIES = ("round-robin", "prefix", "precise-prefix")
WORKLOADS = ("eviction", "uniform", "replicated")
VLLM_BLOCK = 16


@dataclass
class KvEventsConfig:
    policies: list[str] = field(default_factory=lambda: list(KV_POLICIES))
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    backends: int = 4
    concurrency: int = 16
    round_size: int = 128
    time_scale: float = 1.0
    output_len: int = 48
    question_len: int = 64
    # eviction: Zipf groups, the prefix set >= 4x one backend's cache
    eviction_groups: int = 48
    eviction_count: int = 512
    eviction_system_len: int = 768
    eviction_cache_share: float = 0.2
    zipf_s: float = 1.1
    # uniform: the prefix benchmark's workload
    uniform_groups: int = 32
    uniform_prompts_per_group: int = 16
    uniform_system_len: int = 768
    uniform_cache_share: float = 1 / 3
    replicas: bool = True
    replica_count: int = 400
    tokenizer: Path | None = None  # a tokenizer directory; default: generated into the cache directory
    scrape_interval: float = 0.5
    seed: int = 0
    base_port: int = 18900
    profiles: dict[str, Any] = field(default_factory=dict)
    out: Path = Path("reports/routing")
    include_requests: bool = True


@dataclass(frozen=True)
class Workload:
    name: str
    config: WorkloadConfig
    cache_share: float
    replicas: int = 1  # gateways per policy, taking requests in turn


def workloads(cfg: KvEventsConfig) -> list[Workload]:
    out = []
    for name in cfg.workloads:
        if name in ("eviction", "replicated"):
            w = WorkloadConfig(kind="shared-prefix", count=cfg.eviction_count, seed=cfg.seed, ignore_eos=True,
                               output_len=cfg.output_len, groups=cfg.eviction_groups, prompts_per_group=64,
                               system_len=cfg.eviction_system_len, question_len=cfg.question_len,
                               popularity="zipf", zipf_s=cfg.zipf_s)
            out.append(Workload(name, w, cfg.eviction_cache_share, 2 if name == "replicated" else 1))
        elif name == "uniform":
            w = WorkloadConfig(kind="shared-prefix", seed=cfg.seed, ignore_eos=True, output_len=cfg.output_len,
                               groups=cfg.uniform_groups, prompts_per_group=cfg.uniform_prompts_per_group,
                               system_len=cfg.uniform_system_len, question_len=cfg.question_len)
            out.append(Workload(name, w, cfg.uniform_cache_share))
        else:
            raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    return out


def tokenizer_dir(cfg: KvEventsConfig) -> Path:
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    from gateway.llamacpp.build import cache_dir
    from gateway.sim.tokenizer_files import ensure_tokenizer

    return ensure_tokenizer(cache_dir() / "tokenizer")


@dataclass
class Prompts:
    """The workload's prompts as the emulated engines tokenize them, and the cache size that follows."""

    tokens: list[list[int]]
    prefix_set_tokens: int
    kv_capacity_tokens: int


def measure_prompts(requests: Sequence[BenchRequest], tokenizer: Path, share: float) -> Prompts:
    from gateway.sim.hf_tokenizer import HFTokenizer

    hf = HFTokenizer.from_dir(tokenizer)
    tokens = [hf.chat_ids(r.body["messages"]) for r in requests]
    systems: dict[int, int] = {}
    for r in requests:
        if r.group is not None and r.group not in systems:
            systems[r.group] = len(hf.chat_ids(r.body["messages"][:1]))
    prefix_set = sum(systems.values())
    one = max(len(t) for t in tokens) + max(r.output_len for r in requests)
    return Prompts(tokens, prefix_set, max(int(prefix_set * share), 2 * one))


def fleet(cfg: KvEventsConfig, ports: PortPool, kv: int, tokenizer: Path, tag: str) -> list[dict[str, Any]]:
    servers = []
    for i in range(cfg.backends):
        entry = sim_server(f"vllm-{i}", "vllm", ports.take(), cfg.time_scale, {"kv_capacity_tokens": kv})
        entry["tokenizer"] = str(tokenizer)
        entry["kv_events"] = {"endpoint": f"tcp://{HOST}:{ports.take()}",
                              "replay_endpoint": f"tcp://{HOST}:{ports.take()}", "topic": f"kv@{tag}-{i}"}
        servers.append(entry)
    return servers


def gateway_doc(port: int, servers: Sequence[dict[str, Any]], urls: Sequence[str], policy: str, tokenizer: Path,
                cfg: KvEventsConfig) -> dict[str, Any]:
    doc = gateway_config(port, [(s["name"], "vllm", u) for s, u in zip(servers, urls, strict=True)], policy,
                         cfg.scrape_interval, profiles=cfg.profiles)
    for entry, server in zip(doc["backends"], servers, strict=True):
        kv = server["kv_events"]
        entry["kv_events"] = {"endpoint": kv["endpoint"], "replay_endpoint": kv["replay_endpoint"],
                              "topic": kv["topic"]}
    doc["routing"]["tokenizers"] = {SIM_MODEL: str(tokenizer)}
    return doc


def summarize(doc: dict[str, Any], oracle: OracleResult, eviction: bool) -> dict[str, Any]:
    summaries = {name: policy_summary(t) for name, t in doc["targets"].items()}
    hit_rate_of_oracle(summaries, oracle)
    out: dict[str, Any] = {"policies": summaries, "oracle": oracle.as_dict()}
    if "round-robin" in summaries:
        out["against"] = against(summaries, "round-robin")
        out["reference"] = "round-robin"
    targets = []
    precise, approx = summaries.get("precise-prefix"), summaries.get("prefix")
    if precise is not None and eviction:
        targets.append(target_check("precise_of_oracle", precise.get("hit_rate_of_oracle"), 0.95,
                                    "precise-prefix hit rate as a share of the oracle's"))
    if precise is not None and approx is not None:
        ratio = (precise["cache_hit_rate"] / approx["cache_hit_rate"]
                 if precise["cache_hit_rate"] is not None and approx["cache_hit_rate"] else None)
        targets.append(target_check("precise_vs_approximate_hit_rate", ratio, 1.0,
                                    "precise-prefix hit rate over prefix's (never worse)"))
        ttft = (approx["ttft_ms_p50"] / precise["ttft_ms_p50"]
                if precise["ttft_ms_p50"] and approx["ttft_ms_p50"] else None)
        out["precise_vs_approximate"] = {
            "hit_rate_x": ratio, "ttft_p50_x": ttft,
            "ttft_p90_x": (approx["ttft_ms_p90"] / precise["ttft_ms_p90"]
                           if precise["ttft_ms_p90"] and approx["ttft_ms_p90"] else None)}
    out["targets"] = targets
    return out


def run_workload(cfg: KvEventsConfig, work: Workload, tokenizer: Path, ports: PortPool, log: Log) -> dict[str, Any]:
    requests = build_workload(work.config)
    prompts = measure_prompts(requests, tokenizer, work.cache_share)
    kv = prompts.kv_capacity_tokens
    best = vllm_emulator_oracle(prompts.tokens, [r.output_len for r in requests], cfg.backends, kv, VLLM_BLOCK)
    log(f"{work.name}: {len(requests)} requests x {len(cfg.policies)} policies; {work.config.groups} groups "
        f"({work.config.popularity}), prefix set {prompts.prefix_set_tokens:,} tokens, {cfg.backends} vLLM "
        f"emulators caching {kv:,} tokens each ({kv / prompts.prefix_set_tokens:.0%} of the set); oracle hit "
        f"rate {100 * (best.hit_rate or 0):.1f}%")
    workdir = cfg.out / "kv-events" / work.name
    workdir.mkdir(parents=True, exist_ok=True)
    stack = Stack(workdir, log, cfg.scrape_interval, cfg.profiles)
    try:
        targets = []
        for policy in cfg.policies:
            servers = fleet(cfg, ports, kv, tokenizer, f"{work.name}-{policy}")
            urls = stack.fleet(policy, servers)
            gateways = []
            for r in range(work.replicas):
                port = ports.take()
                name = policy if work.replicas == 1 else f"{policy}-r{r}"
                gateways.append(stack.gateway_from_doc(name, port, gateway_doc(port, servers, urls, policy, tokenizer,
                                                                               cfg), len(servers)))
            first = gateways[0]
            targets.append(Target(policy, first.url, SIM_MODEL, pid=first.pid,
                                  replicas=tuple(g.url for g in gateways) if work.replicas > 1 else ()))
        log("all up; running (interleaved)")
        before = host_cpu_times()
        started = time.perf_counter()
        result = run_sync(run_interleaved(targets, requests, Arrival(concurrency=cfg.concurrency), cfg.round_size,
                                          request_timeout=300))
        elapsed = time.perf_counter() - started
        busy = host_busy_share(before, host_cpu_times())
    finally:
        stack.stop()
    config = {**asdict(work.config), "cache_share": work.cache_share, "gateway_replicas": work.replicas,
              "kv_capacity_tokens": kv,
              "prefix_set_tokens": prompts.prefix_set_tokens,
              "mean_prompt_tokens": statistics.fmean(len(t) for t in prompts.tokens)}
    bench = build_report(result, config, include_requests=cfg.include_requests)
    return {"config": config, "host_busy_share": busy, "wall_s": elapsed,
            **summarize(bench, best, eviction=work.name == "eviction"), "bench": bench, **phase_note(result)}


def tokenizer_cost(requests: Sequence[BenchRequest], tokenizer: Path, max_chars: int = 64 * 1024) -> dict[str, Any]:
    """Microseconds per request to render and tokenize: each distinct prompt once with the segment cache cold
    and again warm, and a prompt of ``max_chars`` characters of fresh text (the bound's worst case)."""
    from gateway.kvcache.tokenizer import PromptTokenizer

    tok = PromptTokenizer.from_dir(tokenizer, max_chars=max_chars)
    first: list[float] = []
    again: list[float] = []
    for r in requests:
        start = time.perf_counter()
        tok.chat(r.body)
        first.append(1e6 * (time.perf_counter() - start))
    for r in requests:
        start = time.perf_counter()
        tok.chat(r.body)
        again.append(1e6 * (time.perf_counter() - start))
    import random

    rng = random.Random(1)
    text = " ".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 8))) for _ in range(max_chars // 5))
    body = {"messages": [{"role": "user", "content": text[: max_chars * 2]}]}
    start = time.perf_counter()
    ids = tok.chat(body)
    worst = 1e6 * (time.perf_counter() - start)

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"requests": len(requests), "first_us_p50": pct(first, 0.5), "first_us_p99": pct(first, 0.99),
            "warm_us_p50": pct(again, 0.5), "warm_us_p99": pct(again, 0.99),
            "max_chars": max_chars, "max_chars_us": worst, "max_chars_tokens": len(ids or []),
            "segment_cache_hits": tok.cache_hits, "segment_cache_misses": tok.cache_misses}


def run_kv_events(cfg: KvEventsConfig, log: Log = print) -> dict[str, Any]:
    tokenizer = tokenizer_dir(cfg)
    ports = PortPool(cfg.base_port)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results: dict[str, Any] = {}
    for work in workloads(cfg):
        results[work.name] = run_workload(cfg, work, tokenizer, ports, log)
    doc: dict[str, Any] = {"schema": "gateway-bench-routing/1", "benchmark": "kv-events", "created": started,
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                           "tokenizer": str(tokenizer), "workloads": results}
    first = workloads(cfg)[0]
    doc["tokenization"] = tokenizer_cost(build_workload(first.config), tokenizer)
    if cfg.replicas:
        from gateway.bench.routing.replicas import run_replicas

        doc["replicas"] = run_replicas(cfg, first, tokenizer, ports, log)
    targets = [dict(t, workload=name) for name, r in results.items() for t in r.get("targets", [])]
    if "replicas" in doc:
        targets.append(target_check("replica_agreement", doc["replicas"]["agreement"], 0.99,
                                    "two replicas on the same events decide alike"))
    doc["targets"] = targets
    return doc


def plot_kv_events(doc: dict[str, Any], path: Path) -> Path:
    """Per workload: cache-hit rate per policy against the oracle's, and TTFT p50/p90."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    works = doc["workloads"]
    fig, axes = plt.subplots(len(works), 2, figsize=(12, 4.2 * len(works)), squeeze=False)
    for row, (name, result) in enumerate(works.items()):
        pol = result["policies"]
        names = list(pol)
        xs = range(len(names))
        ax = axes[row][0]
        bars = ax.bar(list(xs), [100 * (pol[n]["cache_hit_rate"] or 0) for n in names], color="tab:green")
        oracle = result.get("oracle") or {}
        if oracle.get("hit_rate") is not None:
            ax.axhline(100 * oracle["hit_rate"], color="black", linestyle="--", label="oracle")
            ax.bar_label(bars, [f"{100 * pol[n]['hit_rate_of_oracle']:.0f}%\nof oracle"
                                if pol[n].get("hit_rate_of_oracle") is not None else "" for n in names],
                         label_type="center", color="white", fontsize=9)
            ax.legend(loc="lower right")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("cache-hit rate (% of prompt tokens)")
        c = result["config"]
        gateways = f", {c['gateway_replicas']} gateway replicas" if c.get("gateway_replicas", 1) > 1 else ""
        ax.set_title(f"{name}: {c['groups']} groups ({c['popularity']}), caches "
                     f"{c['kv_capacity_tokens'] / c['prefix_set_tokens']:.0%} of the set{gateways}")
        ax.grid(alpha=0.3, axis="y")
        ax = axes[row][1]
        width = 0.4
        ax.bar([x - width / 2 for x in xs], [pol[n]["ttft_ms_p50"] or 0 for n in names], width, label="p50")
        ax.bar([x + width / 2 for x in xs], [pol[n]["ttft_ms_p90"] or 0 for n in names], width, label="p90")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("TTFT (ms)")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
    replicas = doc.get("replicas")
    title = "prefix routing on KV events (precise) vs the gateway's guess (prefix), 4 emulated vLLM"
    if replicas and replicas.get("agreement") is not None:
        title += f"; two replicas agree on {100 * replicas['agreement']:.1f}% of decisions"
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_kv_events(doc: dict[str, Any]) -> None:
    from gateway.bench.routing.prefix import print_policies

    for name, result in doc["workloads"].items():
        print_policies(result, f"{name} workload")
        pva = result.get("precise_vs_approximate")
        if pva:
            print(f"precise / approximate: hit rate x{pva['hit_rate_x'] or 0:.3f}, "
                  f"TTFT p50 x{pva['ttft_p50_x'] or 0:.2f}, p90 x{pva['ttft_p90_x'] or 0:.2f} (above 1: better)")
    tok = doc.get("tokenization") or {}
    if tok:
        print(f"tokenizing a request: first {tok['first_us_p50']:.0f} us p50 / {tok['first_us_p99']:.0f} us p99, warm "
              f"{tok['warm_us_p50']:.0f} / {tok['warm_us_p99']:.0f} us; a {tok['max_chars']:,}-character prompt "
              f"{tok['max_chars_us'] / 1000:.1f} ms ({tok['max_chars_tokens']:,} tokens)")
    replicas = doc.get("replicas")
    if replicas:
        reasons = ", ".join(f"{r} {v['decisions']} at {100 * v['agreement']:.1f}%"
                            for r, v in replicas["by_reason"].items())
        print(f"replicas: {100 * (replicas['agreement'] or 0):.2f}% of {replicas['requests']} decisions alike "
              f"({replicas['failed']} failed); by reason: {reasons}")
    for t in doc.get("targets", []):
        print(f"{'met' if t['met'] else 'MISSED'}: {t['what']} ({t.get('workload', '')}): "
              f"{t['value'] if t['value'] is None else round(t['value'], 3)} (goal {t['goal']})")
