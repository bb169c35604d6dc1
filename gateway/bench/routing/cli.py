"""``gateway bench routing {prefix,shape,real-prefix,real-shape,kv-events}``: routing policies measured.

Every benchmark starts what it needs as separate processes on loopback (emulated fleets with
``python -m gateway.sim fleet --config FILE``, real ``llama-server`` processes, and one gateway per policy with
``python -m gateway serve --config FILE``), gives **each policy its own fresh backends and its own gateway**
(so one policy never warms another's caches), drives all gateways with the bench runner's interleaved
``--compare`` machinery (the same requests to every target, round by round, the order rotated each round),
stops every process it started, and writes ``reports/routing/NAME.json`` and ``NAME.png`` (plus the configs
and the processes' logs under ``reports/routing/NAME/``) and prints a table.

* ``prefix``: the shared-prefix workload (default 32 groups of ~1,536-token system prompts, uniform popularity)
  on 4 emulated vLLM-like backends whose prefix caches (``kv_capacity_tokens``) each hold about a third of the
  prefix set. Policies round-robin, least-load, prefix and default. Realized cache-hit rate (cached / prompt
  tokens, from usage), TTFT p50/p90, throughput, and each against round-robin; each hit rate also as a share of
  the oracle's (``oracle.py``: the best placement found knowing the whole sequence, on the same caches). Target:
  prefix TTFT p50 at least 3x better than round-robin.
* ``shape``: closed-loop ramp of 1, 2, 4, ..., 64 users on one ExLlamaV2-like (TabbyAPI) and one vLLM-like
  emulated backend: least-load vs engine-shape (each its own pair of backends and gateway), and each engine
  alone behind a single-backend gateway as the reference. End-to-end p50/p90 per level. Targets: engine-shape
  p90 at least 1.3x better than least-load; at no level worse than the better engine alone. The gateways are
  seeded from a ``gateway profile`` run of a copy of the fleet (``shape-profile.json``), not from the emulator's
  constants; ``--seed-from engine-defaults`` seeds from the engine specs instead, ``--compare-seeding`` runs both.
* ``real-prefix``: prefix vs round-robin on 3 real ``llama-server`` processes per policy (the generated "large"
  model, 2 slots, 1 thread each) with ~1.5k-token shared prefixes: TTFT and cache hits (``timings.cache_n``
  as usage ``cached_tokens``), and the oracle's hit rate on the servers' slots (prompts tokenized by them).
* ``real-shape``: engine-shape vs least-load on two real ``llama-server`` processes of different shapes (1 slot
  x 2 threads, 4 slots x 1 thread) per policy, seeded from a profile of such a pair, over 1, 2, 4, 8 users:
  aggregate tokens/s, TTFT p50/p90, requests per backend.
* ``kv-events``: precise-prefix (the engines' KV events) vs prefix (the gateway's guess) vs round-robin and
  the oracle on 4 emulated vLLM servers publishing their events and tokenizing with a generated tokenizer
  file; an eviction-heavy Zipf workload and the uniform one; two replicas' agreement; the tokenizer's cost
  (see ``kv_events.py``).

A ratio "x better" is reference / this for latencies and this / reference for throughput and hit rate, so
above 1 is always better.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from gateway.bench.report import write_json
from gateway.bench.routing.kv_events import KvEventsConfig, plot_kv_events, print_kv_events, run_kv_events
from gateway.bench.routing.prefix import (
    PrefixConfig,
    plot_policies,
    print_policies,
    run_prefix,
)
from gateway.bench.routing.real_prefix import (
    RealPrefixConfig,
    run_real_prefix,
)
from gateway.bench.routing.real_shape import RealShapeConfig, plot_real_shape, print_real_shape, run_real_shape
from gateway.bench.routing.seeding import SEEDINGS
from gateway.bench.routing.shape import (
    ShapeConfig,
    plot_shape,
    print_shape,
    run_shape,
)
from gateway.bench.routing.stack import (
    load_profiles,
)


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _policies(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _seeding_options(parser: argparse.ArgumentParser, default: str, fleet: str) -> None:
    parser.add_argument("--seed-from", choices=SEEDINGS, default=default,
                        help=f"seed the gateways' shape model from a profile {fleet}, or from the engine specs")
    parser.add_argument("--compare-seeding", action="store_true", help="also run engine-shape seeded the other way")


def _seeding(args: argparse.Namespace, common: dict[str, Any]) -> dict[str, Any]:
    return {"policies": _policies(args.policies), "seed_from": args.seed_from,
            "compare_seeding": args.compare_seeding, **common}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway bench routing", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=Path("reports/routing"), help="report directory")
    common.add_argument("--scrape-interval", type=float, default=0.5,
                        help="the gateways' scrape interval (s); each idle gateway scraping 4 emulators every 0.2 s "
                             "costs ~14%% of a core here")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--base-port", type=int, help="first loopback port to try")
    common.add_argument("--no-requests", action="store_true", help="leave per-request records out of the JSON")
    common.add_argument("--profiles", type=Path, metavar="FILE.yaml",
                        help="extra routing profiles (name: {scorers, picker, ...}) for every gateway; name them "
                             "in --policies")

    a = sub.add_parser("prefix", parents=[common], help="(a) shared prefixes on 4 emulated vLLM-like backends",
                       description="Round-robin vs least-load vs prefix vs default on a shared-prefix workload; "
                                   "each policy with its own 4 emulated vLLM-like backends and gateway.")
    d = PrefixConfig()
    a.add_argument("--policies", default=",".join(d.policies), help="the first is the reference")
    a.add_argument("--backends", type=int, default=d.backends)
    a.add_argument("--groups", type=int, default=d.groups)
    a.add_argument("--prompts-per-group", type=int, default=d.prompts_per_group)
    a.add_argument("--system-len", type=int, default=d.system_len, help="system prompt words (= emulator tokens)")
    a.add_argument("--question-len", type=int, default=d.question_len)
    a.add_argument("--output-len", type=int, default=d.output_len)
    a.add_argument("--popularity", choices=("uniform", "zipf"), default=d.popularity)
    a.add_argument("--count", type=int, help="requests per policy (default: one pass, groups x prompts)")
    a.add_argument("--cache-share", type=float, default=d.cache_share, help="of the prefix set, per backend")
    a.add_argument("--concurrency", type=int, default=d.concurrency)
    a.add_argument("--round-size", type=int, default=d.round_size)
    a.add_argument("--time-scale", type=float, default=d.time_scale)
    a.add_argument("--replicas", type=int, default=d.replicas, metavar="N",
                   help="also each prefix-routing policy through N gateway replicas sharing a loopback "
                        "redis-server; reports their hit rate against one gateway's")
    a.add_argument("--tenants", default="", metavar="N,M",
                   help="also every policy through a gateway with N (then M) API keys, each its own cache domain "
                        "(request i with key i mod N); reports the hit rate against one domain's")

    b = sub.add_parser("shape", parents=[common], help="(b) concurrency ramp on ExLlamaV2-like + vLLM-like",
                       description="least-load vs engine-shape, each with its own TabbyAPI-like + vLLM-like pair, "
                                   "and each engine alone, over a closed-loop concurrency ramp.")
    s = ShapeConfig()
    b.add_argument("--levels", default=",".join(map(str, s.levels)))
    b.add_argument("--policies", default=",".join(s.policies))
    b.add_argument("--no-alone", action="store_true", help="without the engines-alone references")
    b.add_argument("--rounds", type=int, default=s.rounds)
    b.add_argument("--min-round", type=int, default=s.min_round)
    b.add_argument("--input-len", type=int, default=s.input_len)
    b.add_argument("--output-len", type=int, default=s.output_len)
    b.add_argument("--time-scale", type=float, default=s.time_scale)
    _seeding_options(b, s.seed_from, "of this fleet")
    b.add_argument("--profile-levels", help="the profile's levels (default: 1, 4, 16, ... and the top level)")
    b.add_argument("--quick", action="store_true", help="a short run: levels 1,4, one round, fast emulators "
                                                        "(the size options above are ignored)")

    e = sub.add_parser("real-shape", parents=[common], help="(d) engine-shape vs least-load on real llama-server",
                       description="engine-shape vs least-load, each with its own pair of llama-server processes "
                                   "of different shapes and a gateway seeded from a profile of such a pair.")
    rs = RealShapeConfig()
    e.add_argument("--levels", default=",".join(map(str, rs.levels)))
    e.add_argument("--policies", default=",".join(rs.policies))
    e.add_argument("--rounds", type=int, default=rs.rounds)
    e.add_argument("--min-round", type=int, default=rs.min_round)
    e.add_argument("--input-len", type=int, default=rs.input_len)
    e.add_argument("--output-len", type=int, default=rs.output_len)
    e.add_argument("--model-size", choices=("tiny", "large"), default=rs.model_size)
    e.add_argument("--profile-levels", default=",".join(map(str, rs.profile_levels)))
    _seeding_options(e, rs.seed_from, "of such a pair")
    e.add_argument("--quick", action="store_true", help="tiny model, levels 1,4, one short round (size options "
                                                        "ignored)")

    c = sub.add_parser("real-prefix", parents=[common], help="(c) prefix vs round-robin on real llama-server",
                       description="prefix vs round-robin, each with its own 3 llama-server processes (generated "
                                   "'large' model) and gateway.")
    r = RealPrefixConfig()
    c.add_argument("--policies", default=",".join(r.policies))
    c.add_argument("--servers", type=int, default=r.servers)
    c.add_argument("--slots", type=int, default=r.slots)
    c.add_argument("--threads", type=int, default=r.threads)
    c.add_argument("--groups", type=int, default=r.groups)
    c.add_argument("--prompts-per-group", type=int, default=r.prompts_per_group)
    c.add_argument("--system-len", type=int, default=r.system_len)
    c.add_argument("--question-len", type=int, default=r.question_len)
    c.add_argument("--output-len", type=int, default=r.output_len)
    c.add_argument("--count", type=int)
    c.add_argument("--concurrency", type=int, default=r.concurrency)
    c.add_argument("--round-size", type=int, default=r.round_size)

    k = sub.add_parser("kv-events", parents=[common], help="(e) precise (KV events) vs approximate prefix routing",
                       description="round-robin vs prefix (the gateway's guess) vs precise-prefix (the engines' KV "
                                   "events) against the oracle, on 4 emulated vLLM servers publishing their events: "
                                   "an eviction-heavy Zipf workload and the uniform one; then two replicas on the "
                                   "same events.")
    kd = KvEventsConfig()
    k.add_argument("--policies", default=",".join(kd.policies))
    k.add_argument("--workloads", default=",".join(kd.workloads), help="eviction, uniform")
    k.add_argument("--backends", type=int, default=kd.backends)
    k.add_argument("--concurrency", type=int, default=kd.concurrency)
    k.add_argument("--count", type=int, default=kd.eviction_count, help="requests of the eviction workload")
    k.add_argument("--time-scale", type=float, default=kd.time_scale)
    k.add_argument("--no-replicas", action="store_true", help="skip the two-replica agreement run")
    k.add_argument("--replica-count", type=int, default=kd.replica_count)
    k.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: the generated one)")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out
    try:
        profiles = load_profiles(args.profiles)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    common: dict[str, Any] = {"out": out, "scrape_interval": args.scrape_interval, "seed": args.seed,
                              "profiles": profiles}
    if args.base_port:
        common["base_port"] = args.base_port
    name = args.bench
    if name == "kv-events":
        kcfg = KvEventsConfig(policies=_policies(args.policies), workloads=_policies(args.workloads),
                              backends=args.backends, concurrency=args.concurrency, time_scale=args.time_scale,
                              eviction_count=args.count, replicas=not args.no_replicas,
                              replica_count=args.replica_count, tokenizer=args.tokenizer,
                              include_requests=not args.no_requests, **common)
        doc = run_kv_events(kcfg)
        json_path = write_json(doc, out / "kv-events.json")
        png = plot_kv_events(doc, out / "kv-events.png")
        print_kv_events(doc)
    elif name == "prefix":
        pcfg = PrefixConfig(policies=_policies(args.policies), backends=args.backends, groups=args.groups,
                            prompts_per_group=args.prompts_per_group, system_len=args.system_len,
                            question_len=args.question_len, output_len=args.output_len,
                            popularity=args.popularity, count=args.count, cache_share=args.cache_share,
                            concurrency=args.concurrency, round_size=args.round_size, time_scale=args.time_scale,
                            replicas=max(1, args.replicas), include_requests=not args.no_requests,
                            tenants=[int(n) for n in args.tenants.split(",") if n.strip()], **common)
        doc = run_prefix(pcfg)
        json_path = write_json(doc, out / "prefix.json")
        png = plot_policies(doc, out / "prefix.png",
                            f"shared prefixes: {pcfg.groups} groups x ~{pcfg.system_len} tokens, "
                            f"{pcfg.backends} vLLM-like backends caching ~{pcfg.cache_share:.0%} of the set each")
        print_policies(doc, "shared prefixes on emulated vLLM-like backends")
    elif name == "shape":
        seeding = _seeding(args, common)
        if args.quick:
            scfg = ShapeConfig.quick(**seeding)
        else:
            scfg = ShapeConfig(levels=_levels(args.levels), alone=not args.no_alone, rounds=args.rounds,
                               min_round=args.min_round, input_len=args.input_len, output_len=args.output_len,
                               time_scale=args.time_scale,
                               profile_levels=_levels(args.profile_levels) if args.profile_levels else None,
                               **seeding)
        doc = run_shape(scfg)
        json_path = write_json(doc, out / "shape.json")
        png = plot_shape(doc, out / "shape.png")
        print_shape(doc)
    elif name == "real-shape":
        seeding = _seeding(args, common)
        if args.quick:
            tcfg = RealShapeConfig.quick(**seeding)
        else:
            tcfg = RealShapeConfig(levels=_levels(args.levels), rounds=args.rounds, min_round=args.min_round,
                                   input_len=args.input_len, output_len=args.output_len, model_size=args.model_size,
                                   profile_levels=_levels(args.profile_levels), **seeding)
        doc = run_real_shape(tcfg)
        json_path = write_json(doc, out / "real-shape.json")
        png = plot_real_shape(doc, out / "real-shape.png")
        print_real_shape(doc)
    else:
        rcfg = RealPrefixConfig(policies=_policies(args.policies), servers=args.servers, slots=args.slots,
                                threads=args.threads, groups=args.groups, prompts_per_group=args.prompts_per_group,
                                system_len=args.system_len, question_len=args.question_len,
                                output_len=args.output_len, count=args.count, concurrency=args.concurrency,
                                round_size=args.round_size, include_requests=not args.no_requests, **common)
        doc = run_real_prefix(rcfg)
        json_path = write_json(doc, out / "real-prefix.json")
        png = plot_policies(doc, out / "real-prefix.png",
                            f"shared prefixes on {rcfg.servers} real llama-server ({rcfg.slots} slots, "
                            f"{rcfg.threads} thread) per policy, ~{doc['mean_prompt_tokens'] or 0:.0f}-token prompts")
        print_policies(doc, "shared prefixes on real llama-server")
    print(f"wrote {json_path} and {png}")
    return 0
