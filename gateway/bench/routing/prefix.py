"""(a) ``gateway bench routing prefix``: shared prefixes on emulated vLLM-like backends.

``--replicas N`` adds, for each prefix-routing policy, the same policy through N gateway replicas sharing one
loopback ``redis-server`` (``state.url``; each policy its own key prefix), with its own fleet, the client
sending requests to the replicas in turn as a round-robin load balancer would: its cache-hit rate against one
gateway's (target: at least 0.9 of it) says whether the replicas agree on where each prefix lives.

``--tenants 3,16`` adds, for each policy, the same workload through a gateway with that many API keys, each its
own cache domain (request i sent with key i mod N), with its own fleet: what keeping tenants apart in the caches
costs in hit rate, against the one-domain run of the same policy."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.client import Target
from gateway.bench.report import build_report
from gateway.bench.routing.oracle import OracleResult, hit_rate_of_oracle, vllm_emulator_oracle
from gateway.bench.routing.stack import (
    PREFIX_POLICIES,
    SIM_MODEL,
    SYSTEM_OVERHEAD_TOKENS,
    Log,
    PortPool,
    Stack,
    against,
    fmt,
    gateway_config,
    phase_note,
    policy_summary,
    print_targets,
    rich_console,
    run_interleaved,
    sim_server,
    target_check,
)
from gateway.bench.runner import (
    Arrival,
    host_busy_share,
    host_cpu_times,
    run_sync,
)
from gateway.bench.workload import BenchRequest, WorkloadConfig, build_workload


@dataclass
class PrefixConfig:
    policies: list[str] = field(default_factory=lambda: list(PREFIX_POLICIES))
    backends: int = 4
    groups: int = 32
    prompts_per_group: int = 16
    system_len: int = 1536
    question_len: int = 64
    output_len: int = 48
    popularity: str = "uniform"
    count: int | None = None  # default: one pass (groups x prompts_per_group)
    cache_share: float = 1 / 3  # of the prefix set, per backend
    concurrency: int = 16
    round_size: int = 128
    time_scale: float = 1.0
    scrape_interval: float = 0.5
    seed: int = 0
    base_port: int = 18700
    profiles: dict[str, Any] = field(default_factory=dict)  # extra routing.profiles for every gateway
    replicas: int = 1  # above 1: each prefix-routing policy also through that many replicas sharing a Redis
    tenants: list[int] = field(default_factory=list)  # each above 1: every policy also with that many API keys
    out: Path = Path("reports/routing")
    include_requests: bool = True


def prefix_set_tokens(groups: int, system_len: int) -> int:
    """Tokens of all the distinct system prompts as the emulators count them (one per word, plus the
    template's and the header's)."""
    return groups * (system_len + SYSTEM_OVERHEAD_TOKENS)


def kv_capacity_for(groups: int, system_len: int, share: float, question_len: int = 0, output_len: int = 0) -> int:
    """A backend cache holding ``share`` of the prefix set (in the emulators' tokens), and at least two whole
    requests (the emulators also bound one request's prompt + output by it)."""
    one = system_len + question_len + output_len + 2 * SYSTEM_OVERHEAD_TOKENS
    return max(int(prefix_set_tokens(groups, system_len) * share), 2 * one)


def prefix_workload(cfg: PrefixConfig) -> WorkloadConfig:
    return WorkloadConfig(kind="shared-prefix", count=cfg.count, seed=cfg.seed, output_len=cfg.output_len,
                          ignore_eos=True, groups=cfg.groups, prompts_per_group=cfg.prompts_per_group,
                          system_len=cfg.system_len, question_len=cfg.question_len,
                          popularity="zipf" if cfg.popularity == "zipf" else "uniform")


def prefix_fleet(policy: str, cfg: PrefixConfig, ports: Sequence[int]) -> list[dict[str, Any]]:
    kv = kv_capacity_for(cfg.groups, cfg.system_len, cfg.cache_share, cfg.question_len, cfg.output_len)
    return [sim_server(f"vllm-{i}", "vllm", port, cfg.time_scale, {"kv_capacity_tokens": kv})
            for i, port in enumerate(ports)]


def emulated_oracle(requests: Sequence[BenchRequest], cfg: PrefixConfig) -> OracleResult:
    """The oracle (see ``oracle.py``) over the emulated vLLM caches: prompts tokenized as the emulators do."""
    from gateway.sim.engines.vllm import block_size
    from gateway.sim.template import render_chat
    from gateway.sim.tokenizer import Tokenizer

    tokenizer = Tokenizer()
    prompts = [tokenizer.encode(render_chat(r.body["messages"])) for r in requests]
    kv = kv_capacity_for(cfg.groups, cfg.system_len, cfg.cache_share, cfg.question_len, cfg.output_len)
    block = block_size("0.33.0")  # (the release prefix_fleet's servers run: the emulator's default)
    return vllm_emulator_oracle(prompts, [r.output_len for r in requests], cfg.backends, kv, block)


REPLICATED_POLICIES = ("prefix", "default", "consistent-prefix")


def replicated_name(policy: str, replicas: int) -> str:
    return f"{policy} x{replicas}"


def tenants_name(policy: str, tenants: int) -> str:
    return f"{policy} /{tenants} keys"


def tenant_keys(tenants: int) -> list[str]:
    return [f"bench-tenant-{i}" for i in range(tenants)]


def tenants_auth(tenants: int) -> dict[str, Any]:
    """The ``auth`` section of a gateway with ``tenants`` keys, each its own cache domain."""
    return {"keys": [{"name": key, "key_sha256": hashlib.sha256(key.encode()).hexdigest()}
                     for key in tenant_keys(tenants)]}


def tenants_summary(summaries: dict[str, dict[str, Any]], tenants: Sequence[int]) -> dict[str, Any]:
    """Per policy: its cache-hit rate with one cache domain and with each number of keys, and each as a share of
    the one-domain rate (the cost of keeping the keys apart)."""
    out: dict[str, Any] = {}
    for policy, one in summaries.items():
        if " /" in policy or " x" in policy:
            continue
        rates: dict[str, Any] = {"1": one["cache_hit_rate"]}
        shares: dict[str, Any] = {"1": 1.0 if one["cache_hit_rate"] else None}
        for n in tenants:
            many = summaries.get(tenants_name(policy, n))
            if many is None:
                continue
            rates[str(n)] = many["cache_hit_rate"]
            shares[str(n)] = (many["cache_hit_rate"] / one["cache_hit_rate"]
                              if many["cache_hit_rate"] is not None and one["cache_hit_rate"] else None)
        out[policy] = {"hit_rate": rates, "share_of_one_domain": shares}
    return out


def replicas_summary(summaries: dict[str, dict[str, Any]], replicas: int) -> dict[str, Any]:
    """Per policy run both ways: the replicas' cache-hit rate as a share of one gateway's (target >= 0.9)."""
    out: dict[str, Any] = {}
    for policy, one in summaries.items():
        many = summaries.get(replicated_name(policy, replicas))
        if many is None:
            continue
        share = (many["cache_hit_rate"] / one["cache_hit_rate"]
                 if many["cache_hit_rate"] is not None and one["cache_hit_rate"] else None)
        out[policy] = {"one_gateway": one["cache_hit_rate"], "replicas": many["cache_hit_rate"],
                       "share_of_one": share,
                       "target": target_check(f"{policy}_replicas_hit_rate", share, 0.9,
                                              f"{policy}: hit rate through {replicas} replicas / one gateway's")}
    return out


def summarize_prefix(doc: dict[str, Any], reference: str = "round-robin",
                     oracle: OracleResult | None = None, real: bool = False) -> dict[str, Any]:
    """Per-policy figures, ratios against ``reference`` and the targets. On the emulated fleet: prefix TTFT
    p50 3x round-robin's. On real engines (``real``), for each prefix-routing policy run (prefix, default):
    at least 90% of the oracle's hit rate, and TTFT p50, TTFT p90 and tokens/s all better than round-robin."""
    summaries = {name: policy_summary(t) for name, t in doc["targets"].items()}
    out: dict[str, Any] = {"policies": summaries}
    if oracle is not None:
        hit_rate_of_oracle(summaries, oracle)
        out["oracle"] = oracle.as_dict()
    if reference in summaries:
        out["against"] = against(summaries, reference)
        out["reference"] = reference
        if real:
            targets = []
            for policy in (p for p in ("prefix", "default") if p in summaries):
                ratios = out["against"][policy]
                targets.append(target_check(f"{policy}_of_oracle", summaries[policy].get("hit_rate_of_oracle"),
                                            0.9, f"{policy} hit rate as a share of the oracle's"))
                for key, what in (("ttft_p50_x", "TTFT p50"), ("ttft_p90_x", "TTFT p90"),
                                  ("throughput_x", "tokens/s")):
                    # "better": above 1.0 (a tie is not better)
                    value = ratios[key]
                    check = target_check(f"{policy}_{key}", value, 1.0, f"{policy} {what} vs round-robin")
                    check["met"] = value is not None and value > 1.0
                    targets.append(check)
            out["targets"] = targets
        elif "prefix" in summaries:
            out["targets"] = [target_check("prefix_ttft_p50", out["against"]["prefix"]["ttft_p50_x"], 3.0,
                                           "prefix TTFT p50 vs round-robin")]
    return out


def run_prefix(cfg: PrefixConfig, log: Log = print) -> dict[str, Any]:
    requests = build_workload(prefix_workload(cfg))
    workdir = cfg.out / "prefix"
    workdir.mkdir(parents=True, exist_ok=True)
    ports = PortPool(cfg.base_port)
    stack = Stack(workdir, log, cfg.scrape_interval, cfg.profiles)
    kv = kv_capacity_for(cfg.groups, cfg.system_len, cfg.cache_share, cfg.question_len, cfg.output_len)
    total = prefix_set_tokens(cfg.groups, cfg.system_len)
    best = emulated_oracle(requests, cfg)
    log(f"prefix: {len(requests)} requests x {len(cfg.policies)} policies; {cfg.groups} groups of "
        f"~{cfg.system_len + SYSTEM_OVERHEAD_TOKENS}-token prefixes (set ~{total:,} tokens); "
        f"{cfg.backends} vLLM-like backends per policy, cache {kv:,} tokens each; oracle hit rate "
        f"{100 * (best.hit_rate or 0):.1f}% (unlimited caches: {100 * (best.bound_hit_rate or 0):.1f}%)")
    try:
        targets = []
        for policy in cfg.policies:
            servers = prefix_fleet(policy, cfg, [ports.take() for _ in range(cfg.backends)])
            urls = stack.fleet(policy, servers)
            backends = [(s["name"], "vllm", u) for s, u in zip(servers, urls, strict=True)]
            one = stack.gateway(policy, ports.take(), backends, policy)
            targets.append(Target(one.name, one.url, SIM_MODEL, pid=one.pid))
        if cfg.replicas > 1:
            targets += _replicated(cfg, stack, ports, log)
        for tenants in (n for n in cfg.tenants if n > 1):
            for policy in cfg.policies:
                name = tenants_name(policy, tenants)
                servers = prefix_fleet(name, cfg, [ports.take() for _ in range(cfg.backends)])
                urls = stack.fleet(name.replace(" /", "-").replace(" ", "-"), servers)
                backends = [(s["name"], "vllm", u) for s, u in zip(servers, urls, strict=True)]
                keyed = gateway_config(ports.take(), backends, policy, stack.scrape_interval,
                                       profiles=stack.profiles)
                keyed["auth"] = tenants_auth(tenants)
                one = stack.gateway_from_doc(name.replace(" /", "-").replace(" ", "-"), int(keyed["server"]["port"]),
                                             keyed, len(backends))
                keys = tuple(tenant_keys(tenants))
                targets.append(Target(name, one.url, SIM_MODEL, api_key=keys[0], pid=one.pid, tenant_keys=keys))
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
    config.update(kv_capacity_tokens=kv, prefix_set_tokens=prefix_set_tokens(cfg.groups, cfg.system_len))
    bench = build_report(result, config, include_requests=cfg.include_requests)
    doc: dict[str, Any] = {"schema": "gateway-bench-routing/1", "benchmark": "prefix",
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
                           "host_busy_share": busy, "wall_s": elapsed, **summarize_prefix(bench, oracle=best),
                           "bench": bench, **phase_note(result)}
    if any(n > 1 for n in cfg.tenants):
        doc["tenants"] = tenants_summary(doc["policies"], [n for n in cfg.tenants if n > 1])
    if cfg.replicas > 1:
        doc["replicas"] = replicas_summary(doc["policies"], cfg.replicas)
        doc.setdefault("targets", [])
        doc["targets"] = [*doc["targets"], *(r["target"] for r in doc["replicas"].values())]
    return doc


def _replicated(cfg: PrefixConfig, stack: Stack, ports: PortPool, log: Log) -> list[Target]:
    """For each prefix-routing policy of the run: its own fleet, and ``cfg.replicas`` gateways sharing one
    redis-server (started here, once), taking requests in turn."""
    from gateway.bench.procs import ChildProcess
    from gateway.bench.state_cost import redis_available

    if not redis_available():
        raise RuntimeError("--replicas needs redis-server (Debian: apt-get install redis-server)")
    redis_port = ports.take()
    redis = ChildProcess("redis", ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no"], stack.workdir / "redis.log")
    stack.add(redis)
    wait_tcp(redis_port)
    out = []
    for policy in (p for p in cfg.policies if p in REPLICATED_POLICIES):
        name = replicated_name(policy, cfg.replicas)
        servers = prefix_fleet(name, cfg, [ports.take() for _ in range(cfg.backends)])
        urls = stack.fleet(name.replace(" ", "-"), servers)
        backends = [(s["name"], "vllm", u) for s, u in zip(servers, urls, strict=True)]
        replicas = []
        for r in range(cfg.replicas):
            port = ports.take()
            doc = gateway_config(port, backends, policy, stack.scrape_interval, profiles=stack.profiles)
            doc["state"] = {"url": f"redis://127.0.0.1:{redis_port}/0", "prefix": f"gateway:{policy}:"}
            replicas.append(stack.gateway_from_doc(f"{policy}-r{r}", port, doc, len(backends)).url)
        log(f"{name}: {cfg.replicas} replicas sharing redis on {redis_port}")
        out.append(Target(name, replicas[0], SIM_MODEL, replicas=tuple(replicas)))
    return out


def wait_tcp(port: int, timeout: float = 10.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s") from None
            time.sleep(0.05)


def plot_policies(doc: dict[str, Any], path: Path, title: str) -> Path:
    """TTFT CDF per policy (when per-request records are present), TTFT p50/p90, hit rate and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = doc["policies"]
    names = list(pol)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    records = doc.get("bench", {}).get("requests") or {}
    drawn = 0
    for name in names:
        values = sorted(1000 * r["ttft"] for r in records.get(name, []) if r.get("ok") and r.get("ttft"))
        if values:
            drawn += 1
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    xs = range(len(names))
    ax = axes[0][1]
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [pol[n]["ttft_ms_p50"] or 0 for n in names], width, label="p50")
    ax.bar([x + width / 2 for x in xs], [pol[n]["ttft_ms_p90"] or 0 for n in names], width, label="p90")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("TTFT (ms)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    ax = axes[1][0]
    bars = ax.bar(list(xs), [100 * (pol[n]["cache_hit_rate"] or 0) for n in names], color="tab:green")
    oracle = doc.get("oracle") or {}
    if oracle.get("hit_rate") is not None:
        ax.axhline(100 * oracle["hit_rate"], color="black", linestyle="--", label="oracle")
        if oracle.get("bound_hit_rate") is not None:
            ax.axhline(100 * oracle["bound_hit_rate"], color="grey", linestyle=":", label="unlimited caches")
        ax.bar_label(bars, [fmt(None if pol[n].get("hit_rate_of_oracle") is None
                                else 100 * pol[n]["hit_rate_of_oracle"], 0, "%\nof oracle") for n in names],
                     label_type="center", color="white", fontsize=9)
        ax.legend(loc="lower right")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("cache-hit rate (% of prompt tokens)")
    ax.grid(alpha=0.3, axis="y")
    ax = axes[1][1]
    ax.bar(list(xs), [pol[n]["output_tok_s"] or 0 for n in names], color="tab:purple")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("output tokens/s (while the policy ran)")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_policies(doc: dict[str, Any], title: str) -> None:
    from rich.table import Table

    console = rich_console()
    ref = doc.get("reference")
    table = Table(title=title)
    for col in ("policy", "ok/all", "hit rate", "of oracle", "TTFT p50 ms", "TTFT p90 ms", "E2E p50 ms", "out tok/s",
                f"TTFT p50 x vs {ref}", "TTFT p90 x", "tok/s x", "backends"):
        table.add_column(col, justify="left" if col in ("policy", "backends") else "right")
    for name, s in doc["policies"].items():
        a = doc.get("against", {}).get(name, {})
        table.add_row(name, f"{s['ok']}/{s['requests']}",
                      fmt(None if s["cache_hit_rate"] is None else 100 * s["cache_hit_rate"], 1, "%"),
                      fmt(s.get("hit_rate_of_oracle"), 2),
                      fmt(s["ttft_ms_p50"]), fmt(s["ttft_ms_p90"]), fmt(s["e2e_ms_p50"]),
                      fmt(s["output_tok_s"], 0), fmt(a.get("ttft_p50_x"), 2), fmt(a.get("ttft_p90_x"), 2),
                      fmt(a.get("throughput_x"), 2),
                      " ".join(f"{b.rsplit('-', 1)[-1]}:{n}" for b, n in s["backends"].items()))
    console.print(table)
    oracle = doc.get("oracle")
    if oracle and oracle.get("hit_rate") is not None:
        console.print(f"oracle hit rate {100 * oracle['hit_rate']:.1f}% ({oracle['model']}; with unlimited caches "
                      f"{100 * (oracle['bound_hit_rate'] or 0):.1f}%): {oracle['definition']}")
    print_targets(console, doc.get("targets", []))
    for policy, cost in (doc.get("tenants") or {}).items():
        shares = cost["share_of_one_domain"]
        console.print(f"{policy}: cache-hit rate by keys (cache domains), as a share of one domain's: " + ", ".join(
            f"{n}: {fmt(None if rate is None else 100 * rate, 1, '%')} ({fmt(shares.get(n), 2, 'x')})"
            for n, rate in cost["hit_rate"].items()))
    if doc.get("host_busy_share") is not None:
        console.print(f"host CPU busy during the run: {100 * doc['host_busy_share']:.0f}%")
    for name, s in doc["policies"].items():
        if s["errors"]:
            console.print(f"[red]{name}: {s['errors']} failed[/red]; e.g. {(s['error_samples'] or ['?'])[0]}")


# --- (b) shape --------------------------------------------------------------------------------------------------
