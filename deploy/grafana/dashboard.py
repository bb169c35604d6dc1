#!/usr/bin/env python3
"""The gateway's Grafana dashboard, as code (grafana-foundation-sdk).

    python deploy/grafana/dashboard.py > deploy/grafana/dashboards/gateway.json

The committed JSON must equal this script's output (tests/telemetry/test_dashboard.py checks it), so edit
this file and regenerate rather than editing the JSON in Grafana. Every panel's queries are evaluated against
a real Prometheus scraping the gateway under emulated load in tests/telemetry/test_prometheus_real.py.

Panels filter with the ``$backend`` and ``$model`` template variables (multi-value, "All" = ``.*``) and
query the ``$datasource`` Prometheus data source. Metric names and labels: gateway/telemetry/metrics.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Literal

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

UID = "llm-gateway"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"

# label filters, substituted into every expression
BM = 'backend=~"$backend",model=~"$model"'  # series labelled by backend and model
B = 'backend=~"$backend"'  # series labelled by backend only
# outcomes that are the gateway's or a backend's fault (client errors and client disconnects are not)
FAILED = 'outcome!~"success|client_error|disconnected"'

Kind = Literal["timeseries", "stat"]


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: Kind = "timeseries"
    width: int = 8
    height: int = 8
    min: float | None = 0
    max: float | None = None
    stack: bool = False


@dataclass(frozen=True)
class RowSpec:
    title: str
    panels: tuple[PanelSpec, ...] = field(default_factory=tuple)


def quantiles(metric: str, selector: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.9, 0.99),
              legend_prefix: str = "") -> tuple[Query, ...]:
    """p50/p90/p99 (or ``qs``) of a histogram over the rate interval, optionally per ``by`` label(s)."""
    group = f"{by}, le" if by else "le"
    return tuple(
        Query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
              f"{legend_prefix}p{round(q * 100)}")
        for q in qs
    )


def rate_by(metric: str, selector: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}{{{selector}}}[{RATE}]))"


TRAFFIC = RowSpec("Traffic", (
    PanelSpec("Requests/s by outcome", "Answered requests per second, by outcome (success, client_error, "
              "upstream_error, upstream_failed, upstream_timeout, no_backend, disconnected, gateway_error).",
              "reqps", (Query(rate_by("gateway_requests_total", BM, "outcome"), "{{outcome}}"),), stack=True),
    PanelSpec("Requests/s by status class", "Answered requests per second, by HTTP status class.", "reqps",
              (Query(rate_by("gateway_requests_total", BM, "status_class"), "{{status_class}}"),), stack=True),
    PanelSpec("Requests in flight", "Requests the gateway is handling now (all backends and models).", "short",
              (Query("sum(gateway_requests_in_flight)", "in flight"),)),
    PanelSpec("Failed requests/s by backend and outcome",
              "Requests that failed through the gateway or a backend (not client errors or disconnects). "
              "backend=_unknown: no backend was chosen.", "reqps",
              (Query(rate_by("gateway_requests_total", f"{BM},{FAILED}", "backend, outcome"),
                     "{{backend}} {{outcome}}"),)),
    PanelSpec("Error ratio", "Share of requests that failed through the gateway or a backend.", "percentunit",
              (Query(f"(sum(rate(gateway_requests_total{{{BM},{FAILED}}}[{RATE}])) or vector(0))"
                     f" / sum(rate(gateway_requests_total{{{BM}}}[{RATE}]))", "error ratio"),),
              kind="stat", max=1),
    PanelSpec("Client errors/s by route", "4xx answers per second, by route (unknown models, bad requests, ...).",
              "reqps", (Query(rate_by("gateway_requests_total", f'{BM},status_class="4xx"', "route"),
                              "{{route}}"),)),
))

LATENCY = RowSpec("Latency", (
    PanelSpec("Time to first token", "From the gateway receiving a streamed request to sending its first "
              "generated text.", "s", quantiles("gateway_time_to_first_token_seconds", BM)),
    PanelSpec("Time to first token p90 by backend", "p90 time to first token per backend.", "s",
              quantiles("gateway_time_to_first_token_seconds", BM, by="backend", qs=(0.9,),
                        legend_prefix="{{backend}} ")),
    PanelSpec("Inter-token latency", "Gaps between streamed events carrying generated text, as sent to clients.",
              "s", quantiles("gateway_inter_token_latency_seconds", BM)),
    PanelSpec("Time per output token", "Per request: (last token - first token) / (output tokens - 1).", "s",
              quantiles("gateway_time_per_output_token_seconds", BM)),
    PanelSpec("Queue wait by stage", "stage=gateway: arrival to dispatch, measured by the gateway. "
              "stage=engine: in the engine's queue (vLLM/SGLang's own histogram; llama.cpp and TabbyAPI: time "
              "to first token minus the engine's prompt time). Engines' buckets differ: quantiles across "
              "engines are approximate.", "s",
              quantiles("gateway_queue_wait_seconds", B, by="stage", legend_prefix="{{stage}} ")),
    PanelSpec("Queue wait p90 by backend and stage", "p90 queue wait per backend and stage.", "s",
              quantiles("gateway_queue_wait_seconds", B, by="backend, stage", qs=(0.9,),
                        legend_prefix="{{backend}} {{stage}} ")),
    PanelSpec("Request duration by route", "From receiving a request to its last byte sent, by route.", "s",
              quantiles("gateway_request_duration_seconds", BM, by="route", qs=(0.5, 0.99),
                        legend_prefix="{{route}} ")),
    PanelSpec("Event loop lag", "How much later than due each gateway process's event loop ran a timer: a "
              "stall of the loop delays every stream it carries by as much (p50, p99, and the slowest "
              "process's mean).", "s",
              (*quantiles("gateway_event_loop_lag_seconds", "", qs=(0.5, 0.99)),
               Query(f"max(rate(gateway_event_loop_lag_seconds_sum[{RATE}]) / "
                     f"rate(gateway_event_loop_lag_seconds_count[{RATE}]))", "mean (slowest process)"))),
))

THROUGHPUT = RowSpec("Throughput", (
    PanelSpec("Output tokens/s by engine", "Completion tokens per second (from upstream usage), by engine.",
              "short",
              (Query(f"sum by (engine) (sum by (backend) (rate(gateway_completion_tokens_total{{{BM}}}[{RATE}]))"
                     " * on (backend) group_left (engine) max by (backend, engine) (gateway_backend_up))",
                     "{{engine}}"),), stack=True),
    PanelSpec("Output tokens/s by backend", "Completion tokens per second, by backend.", "short",
              (Query(rate_by("gateway_completion_tokens_total", BM, "backend"), "{{backend}}"),), stack=True),
    PanelSpec("Prompt tokens/s by backend", "Prompt tokens per second (from upstream usage), by backend.", "short",
              (Query(rate_by("gateway_prompt_tokens_total", BM, "backend"), "{{backend}}"),), stack=True),
    PanelSpec("Per-request decode speed", "Per request output tokens/s, (output tokens - 1) / (last - first "
              "token time): p10 is the slow tail.", "short",
              quantiles("gateway_output_tokens_per_second", BM, qs=(0.1, 0.5, 0.9))),
    PanelSpec("Per-request decode speed p50 by backend", "Median per-request output tokens/s, by backend.",
              "short", quantiles("gateway_output_tokens_per_second", BM, by="backend", qs=(0.5,),
                                 legend_prefix="{{backend}} ")),
    PanelSpec("Output tokens/s by model", "Completion tokens per second, by model; of them, reasoning tokens "
              "where the engine reports them (dashed).", "short",
              (Query(rate_by("gateway_completion_tokens_total", BM, "model"), "{{model}}"),
               Query(rate_by("gateway_reasoning_tokens_total", BM, "model"), "{{model}} reasoning"))),
))

BACKENDS = RowSpec("Backends", (
    PanelSpec("Backends ready", "Backends that can take requests now, of those configured.", "short",
              (Query(f"sum(max by (backend) (gateway_backend_ready{{{B}}}))", "ready"),
               Query(f"count(max by (backend) (gateway_backend_up{{{B}}}))", "configured")), kind="stat"),
    PanelSpec("Backend up / ready / drained", "1 when the backend answers (up: ready or loading) / can take "
              "requests / is drained by an operator (the admin API).",
              "short", (Query(f"max by (backend) (gateway_backend_up{{{B}}})", "{{backend}} up"),
                        Query(f"max by (backend) (gateway_backend_ready{{{B}}})", "{{backend}} ready"),
                        Query(f"max by (backend) (gateway_backend_drained{{{B}}})", "{{backend}} drained")),
              max=1.05),
    PanelSpec("Engine running / waiting", "Sequences running and requests queued in each engine, as last read "
              "from its metrics.", "short",
              (Query(f"max by (backend) (gateway_backend_running_requests{{{B}}})", "{{backend}} running"),
               Query(f"max by (backend) (gateway_backend_waiting_requests{{{B}}})", "{{backend}} waiting"))),
    PanelSpec("Gateway in flight by backend", "Requests this gateway (all replicas) has in flight to each backend.",
              "short", (Query(f"sum by (backend) (gateway_backend_in_flight_requests{{{B}}})", "{{backend}}"),),
              stack=True),
    PanelSpec("KV cache usage", "KV cache in use per engine, as last read (engines that report it).",
              "percentunit", (Query(f"max by (backend) (gateway_backend_kv_cache_usage_ratio{{{B}}})",
                                    "{{backend}}"),), max=1),
    PanelSpec("Load reading age", "Seconds since each backend's load was last read successfully: a growing age "
              "means the gateway routes on stale load.", "s",
              (Query(f"max by (backend) (gateway_backend_load_age_seconds{{{B}}})", "{{backend}}"),)),
    PanelSpec("Slot use", "Sequences running on each engine, of the sequences it runs at once (slots).",
              "percentunit",
              (Query(f"max by (backend) (gateway_backend_running_requests{{{B}}})"
                     f" / max by (backend) (gateway_backend_slots{{{B}}})", "{{backend}}"),), max=1),
    PanelSpec("Backend scrape errors/s", "Failed reads of a backend's load, models or capacity.", "short",
              (Query(rate_by("gateway_backend_scrape_errors_total", B, "backend"), "{{backend}}"),), width=16),
))

ROUTING = RowSpec("Routing", (
    PanelSpec("Routing decisions/s by reason", "Which routing plugin made the difference (prefix, session, "
              "engine-shape, least-load, round-robin, consistent-hash, only-candidate, tie).", "reqps",
              (Query(rate_by("gateway_routing_decisions_total", B, "reason"), "{{reason}}"),), stack=True),
    PanelSpec("Routing decisions/s by backend", "Requests routed to each backend.", "reqps",
              (Query(rate_by("gateway_routing_decisions_total", B, "backend"), "{{backend}}"),), stack=True),
    PanelSpec("Prefix cache hit ratio", "Prompt tokens the engines served from their prefix cache, of all "
              "prompt tokens (from upstream usage), by backend.", "percentunit",
              (Query(f"{rate_by('gateway_cached_tokens_total', BM, 'backend')}"
                     f" / {rate_by('gateway_prompt_tokens_total', BM, 'backend')}", "{{backend}}"),
               Query(f"sum(rate(gateway_cached_tokens_total{{{BM}}}[{RATE}]))"
                     f" / sum(rate(gateway_prompt_tokens_total{{{BM}}}[{RATE}]))", "all")), max=1),
    PanelSpec("Prefix index: predicted / reported cached tokens", "For requests whose engine reported its "
              "cached tokens: the prefix index's prediction over the engine's report, by backend and index "
              "(events: the engine's KV events; approximate: what was routed there). Above 1 the index believes "
              "the cache holds more than it does (routing chases evicted prefixes); below 1 it misses hits.",
              "short",
              (Query(f"{rate_by('gateway_prefix_predicted_cached_tokens_total', B, 'backend, index')}"
                     f" / {rate_by('gateway_prefix_reported_cached_tokens_total', B, 'backend, index')}",
                     "{{backend}} {{index}}"),)),
    PanelSpec("Retries/s", "Requests sent again to another backend, by the backend that failed and why "
              "(connect_failed, invalid_output).", "reqps",
              (Query(rate_by("gateway_retries_total", B, "backend, reason"), "{{backend}} {{reason}}"),)),
    PanelSpec("Connections refused/s", "Client connections the server refused or cut by its limits: headers "
              "too large (431), too slow (408), body stalled (408), over the connection cap (503), not HTTP "
              "(400).", "reqps",
              (Query(f"sum by (code) (rate(gateway_connections_refused_total[{RATE}]))", "{{code}}"),)),
    PanelSpec("Structured output invalid/s", "Non-streamed answers that failed their structured-output check, "
              "by backend, engine and what was done (retried, marked); and those passed unchecked (too costly "
              "to check, no validation worker free, past limits.output_check_timeout).", "reqps",
              (Query(rate_by("gateway_structured_output_invalid_total", B, "backend, engine, action"),
                     "{{backend}} ({{engine}}) {{action}}"),
               Query(rate_by("gateway_structured_output_unchecked_total", B, "backend, engine"),
                     "{{backend}} ({{engine}}) unchecked"))),
    PanelSpec("Routing plugin time p99", "p99 time each routing plugin took per request.", "s",
              quantiles("gateway_routing_plugin_seconds", "", by="plugin", qs=(0.99,),
                        legend_prefix="{{plugin}} ")),
))

KV_EVENTS = RowSpec("KV events (vLLM, SGLang)", (
    PanelSpec("KV events/s", "Events received from each engine's KV-event stream (stored, removed, cleared "
              "blocks), batches that were not event batches, and messages dropped unread because what waited to "
              "be applied was at its byte bound.", "short",
              (Query(rate_by("gateway_kv_events_total", B, "backend"), "{{backend}}"),
               Query(rate_by("gateway_kv_event_batches_total", B, "backend"), "{{backend}} batches"),
               Query(rate_by("gateway_kv_event_decode_errors_total", B, "backend"), "{{backend}} undecodable"),
               Query(rate_by("gateway_kv_event_dropped_total", B, "backend"), "{{backend}} dropped"))),
    PanelSpec("Event stream live", "1 while routing trusts the backend's events; 0 while it falls back to the "
              "approximate index (no stream yet, silent, or rebuilding after lost events).", "short",
              (Query(f"max by (backend) (gateway_kv_events_live{{{B}}})", "{{backend}}"),), max=1),
    PanelSpec("Event index size", "Engine blocks each backend's event index holds.", "short",
              (Query(f"max by (backend) (gateway_kv_event_index_blocks{{{B}}})", "{{backend}}"),)),
    PanelSpec("Gaps, replays and resets/s", "Holes in an engine's sequence numbers, replays asked for them (by "
              "result), index resets (restart, epoch, history_lost), and stored blocks dropped because their "
              "parent was never seen.", "short",
              (Query(rate_by("gateway_kv_event_gaps_total", B, "backend"), "{{backend}} gaps"),
               Query(rate_by("gateway_kv_event_replays_total", B, "backend, result"), "{{backend}} replay {{result}}"),
               Query(rate_by("gateway_kv_event_index_resets_total", B, "backend, reason"),
                     "{{backend}} reset {{reason}}"),
               Query(rate_by("gateway_kv_event_orphan_blocks_total", B, "backend"), "{{backend}} orphans")),
              width=24),
))

STATE = RowSpec("Shared state (Redis)", (
    PanelSpec("Shared state up", "1 while each gateway process reaches its shared state (state.url); 0 while it "
              "runs on local state (limits fail open or closed as configured).", "short",
              (Query("min by (instance) (gateway_state_up)", "{{instance}}"),), max=1),
    PanelSpec("Shared-state errors/s", "Failed Redis operations, by operation (admit, acquire, settle, heartbeat, "
              "subscribe, publish, get_response, put_response).", "short",
              (Query(f"sum by (operation) (rate(gateway_state_errors_total[{RATE}]))", "{{operation}}"),)),
    PanelSpec("Admissions by path/s", "Admissions checked against the shared state: from the slots and leases "
              "a process holds (local), from what another request's round trip brought (waited), or with a round "
              "trip to Redis (redis); and the leases topped up ahead of need, in the background (lease top-ups).",
              "short",
              (Query(f"sum by (path) (rate(gateway_state_admissions_total[{RATE}]))", "{{path}}"),
               Query(f"sum(rate(gateway_state_lease_refills_total[{RATE}]))", "lease top-ups"))),
    PanelSpec("Limits unchecked and settlements waiting", "Requests of rate-limited keys passed unchecked while "
              "Redis was down (on_failure: open), settlements dropped, and settlements waiting to be sent.",
              "short",
              (Query(f"sum(rate(gateway_state_fail_open_total[{RATE}]))", "passed unchecked/s"),
               Query(f"sum(rate(gateway_state_settlements_dropped_total[{RATE}]))", "dropped/s"),
               Query("sum(gateway_state_settlements_pending)", "waiting"))),
    PanelSpec("Given back, and messages dropped/s", "Round trips to Redis answered after their request gave up (timed "
              "out or left) or after a resync, whose slots, places and charges were given back; and messages on the "
              "replicas' channels dropped, by reason (unauthenticated: not sealed with this fleet's secret, from a "
              "replica with another one or from someone else publishing to Redis; stale; replayed; malformed).",
              "short",
              (Query(f"sum(rate(gateway_state_abandoned_total[{RATE}]))", "given back"),
               Query(f"sum by (reason) (rate(gateway_state_messages_rejected_total[{RATE}]))", "dropped {{reason}}")),
              width=16),
))

ROWS = (TRAFFIC, LATENCY, THROUGHPUT, BACKENDS, ROUTING, KV_EVENTS, STATE)


def _target(query: Query, ref: str) -> prometheus.Dataquery:
    return (prometheus.Dataquery().expr(query.expr).legend_format(query.legend or "__auto").ref_id(ref)
            .range().datasource(DATASOURCE))


def _panel(spec: PanelSpec, panel_id: int) -> timeseries.Panel | stat.Panel:
    panel: timeseries.Panel | stat.Panel
    if spec.kind == "stat":
        panel = (stat.Panel().graph_mode(common.BigValueGraphMode.AREA)
                 .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
                 .thresholds(dash.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE)
                             .steps([Threshold(None, "green")])))
    else:
        ts = (timeseries.Panel().line_width(1).fill_opacity(10 if spec.stack else 0)
              .show_points(common.VisibilityMode.NEVER)
              .legend(common_builders.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST)
                      .placement(common.LegendPlacement.BOTTOM).show_legend(True))
              .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI)
                       .sort(common.SortOrder.DESCENDING)))
        if spec.stack:
            ts = ts.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
        panel = ts
    panel = (panel.id(panel_id).title(spec.title).description(spec.description).unit(spec.unit).datasource(DATASOURCE)
             .span(spec.width).height(spec.height))
    if spec.min is not None:
        panel = panel.min(spec.min)
    if spec.max is not None:
        panel = panel.max(spec.max)
    for i, query in enumerate(spec.queries):
        panel = panel.with_target(_target(query, chr(ord("A") + i)))
    return panel


def _label_variable(name: str, label: str, query: str) -> dash.QueryVariable:
    return (dash.QueryVariable(name).label(label).datasource(DATASOURCE)
            .query({"query": query, "refId": f"{name}-values", "qryType": 1})
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*")
            .current(VariableOption(selected=True, text="All", value="$__all")))


def build() -> dash.Dashboard:
    board = (
        dash.Dashboard("LLM gateway").uid(UID)
        .description("One OpenAI-compatible endpoint in front of llama.cpp, vLLM, SGLang and TabbyAPI: traffic, "
                     "latency, throughput, backends and routing. Generated by deploy/grafana/dashboard.py.")
        .tags(["llm-gateway", "llm"]).editable().tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now").refresh("30s").timezone("browser")
        .with_variable(dash.DatasourceVariable("datasource").label("Data source").type("prometheus")
                       .current(VariableOption(selected=True, text="Prometheus", value="prometheus")))
        .with_variable(_label_variable("backend", "Backend", "label_values(gateway_backend_up, backend)"))
        .with_variable(_label_variable("model", "Model", "label_values(gateway_requests_total, model)"))
    )
    ids = iter(range(1, 1000))
    for row in ROWS:
        board = board.with_row(dash.Row(row.title).id(next(ids)))
        for spec in row.panels:
            board = board.with_panel(_panel(spec, next(ids)))
    return board


def render() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
