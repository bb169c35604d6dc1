"""The dashboard and rules against a real Prometheus (Debian's ``prometheus``, on PATH; CI installs it).

Prometheus runs on loopback with its own configuration, scraping the test gateway every second while emulated
engines serve a mixed load (streamed and not, four engines, unknown models, a backend gone, structured output
answered outside its schema). Then every query of every dashboard panel, with the template variables
substituted, must return data through Prometheus's HTTP API; every recording rule must produce series and
every rule evaluate without error; ``promtool`` must accept the committed configuration and rules. The panels'
series over the load are rendered to reports/dashboard-preview.png.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from gateway.sim.spec import ENGINES
from gateway.sim.tokenizer_files import ensure_tokenizer
from tests.conftest import free_port, serve_in_thread
from tests.state.conftest import RedisServer
from tests.telemetry.test_dashboard import DASHBOARD_JSON, ROOT, RULES, dashboard, load_script
from tests.waiting import wait_until

PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PREVIEW = ROOT / "reports" / "dashboard-preview.png"
TIME_SCALE = 20.0
LOAD_SECONDS = 5.0
RATE_INTERVAL = "5s"  # what $__rate_interval stands for here: five 1 s scrapes
SYSTEM = "You are a helpful assistant for the gateway's dashboard test. " * 8  # a shared prefix: cache hits

pytestmark = [pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                 reason="needs Debian's prometheus package (prometheus and promtool on PATH)"),
              pytest.mark.system]


def promtool(*args: str) -> str:
    done = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_promtool_accepts_the_committed_config_and_rules() -> None:
    assert "SUCCESS" in promtool("check", "rules", str(RULES))
    assert "SUCCESS" in promtool("check", "config", str(PROMETHEUS_CONFIG))


class Prometheus:
    """``prometheus`` on 127.0.0.1, with a configuration and TSDB in ``tmp``, scraping ``targets`` every second
    and evaluating the committed rules every second."""

    def __init__(self, tmp: Path, targets: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules = yaml.safe_load(RULES.read_text())
        for group in rules["groups"]:
            group["interval"] = "1s"
        (tmp / "rules.yml").write_text(yaml.safe_dump(rules))
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(tmp / "rules.yml")],
                  "scrape_configs": [{"job_name": "gateway", "static_configs": [{"targets": targets}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (tmp / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)
        self.tmp = tmp

    def wait_ready(self, timeout: float = 20.0) -> None:
        def ready() -> bool:
            assert self.process.poll() is None, (self.tmp / "prometheus.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(self.url + "/-/ready", timeout=1).status_code == 200
            return False

        try:
            wait_until(ready, "prometheus ready", within=timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n" + (self.tmp / "prometheus.log").read_text()) from None

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.log.close()


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        prom = Prometheus(tmp_path, targets)
        started.append(prom)
        prom.wait_ready()
        return prom

    yield start
    for prom in started:
        prom.stop()


def structured(client: openai.OpenAI, rng: random.Random) -> None:
    """A JSON-schema request to ``shared``, with a prompt of its own (no prefix or session pulls it to one
    backend): answered by ``wrong`` it fails its schema and is retried on ``right``."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    client.chat.completions.create(
        model="shared", messages=[{"role": "user", "content": f"{rng.random()}: describe a person."}],
        max_tokens=30, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})


def instant(rfc3339: str) -> float:
    """A time in Prometheus's API (RFC 3339, to the nanosecond) as a Unix time."""
    return datetime.datetime.fromisoformat(rfc3339).timestamp()


def evaluated_after(preview: Any, prom: Prometheus, after: float) -> float | None:
    """When the last of the rule groups was last evaluated, once every group has been since ``after``."""
    times = [instant(g["lastEvaluation"]) for g in preview.api(prom.url, "/api/v1/rules", {})["groups"]]
    return max(times) if times and min(times) > after else None


def drive(url: str, until: float) -> None:
    """One client's share of the load until ``until``: mostly streamed chats to each engine's model, some
    non-streamed, legacy completions, unknown models (404), a gone backend's model (502/503) and structured
    requests to the model a misconfigured backend shares (its answers fail their schema: retried)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=10)
    rng = random.Random(threading.get_ident())
    while time.monotonic() < until:
        roll = rng.random()
        model = f"m-{rng.choice(ENGINES)}"
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Question {rng.randrange(4)}: tell me about the weather."}]
        try:
            if roll < 0.55:
                stream = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                        max_tokens=rng.randrange(8, 40), stream=True)
                for _ in stream:
                    pass
            elif roll < 0.7:
                client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                               max_tokens=rng.randrange(4, 24))
            elif roll < 0.78:
                client.completions.create(model=model, prompt=SYSTEM + "Once upon a time", max_tokens=12,
                                          stream=rng.random() < 0.5)
            elif roll < 0.84:
                client.chat.completions.create(model="no-such-model", messages=messages,  # type: ignore[arg-type]
                                               max_tokens=4)
            elif roll < 0.88:
                client.chat.completions.create(model="m-gone", messages=messages,  # type: ignore[arg-type]
                                               max_tokens=4)
            else:
                structured(client, rng)
        except openai.APIError:
            pass  # the errors are part of the load


def test_every_dashboard_panel_returns_data_from_a_real_prometheus(prometheus_factory: Any, tmp_path: Path) -> None:
    preview = load_script("preview")
    board = dashboard()
    tokenizer = ensure_tokenizer(tmp_path)
    # the vLLM server publishes its KV events (the KV events row), tokenizing with the generated tokenizer
    kv = {"vllm": {"kv_events": {"replay_endpoint": "tcp://127.0.0.1:*"}, "tokenizer": str(tokenizer)}}
    # the vLLM model reasons first (and reports its reasoning tokens), for the reasoning-tokens query
    specs = [SimSpec(engine=e, model=f"m-{e}", name=f"sim-{e}", time_scale=TIME_SCALE, reasoning=e == "vllm",
                     **kv.get(e, {})) for e in ENGINES]
    # a TabbyAPI server configured as vLLM ignores vLLM's structured_outputs: its answers fail their schema
    specs += [SimSpec(engine="tabbyapi", model="shared", name="wrong", time_scale=TIME_SCALE),
              SimSpec(engine="vllm", model="shared", name="right", time_scale=TIME_SCALE),
              SimSpec(engine="sglang", model="m-gone", name="gone", time_scale=TIME_SCALE)]
    # the gateway keeps its limits in a real Redis (the shared-state row)
    redis = RedisServer(free_port(), tmp_path).start()
    with FleetThread(specs) as fleet, contextlib.ExitStack() as cleanup:
        cleanup.callback(redis.kill)
        servers = fleet.fleet.servers
        engine_of = {"wrong": "vllm"}
        events = {s.spec.name: {"kv_events": {"endpoint": s.kv_events_endpoint,
                                              "replay_endpoint": s.kv_replay_endpoint}}
                  for s in servers if s.kv_events_endpoint}
        settings = settings_from_mapping({
            "backends": [{"name": s.spec.name, "engine": engine_of.get(str(s.spec.name), s.spec.engine),
                          "url": s.url, **events.get(s.spec.name, {})} for s in servers],
            "routing": {"tokenizers": {"m-vllm": str(tokenizer)}},
            "scrape": {"interval": 0.25, "timeout": 1.0},
            "structured_output": {"validate_outputs": "retry"},
            "state": {"url": redis.url},
        })
        with serve_in_thread(create_app(settings)) as gateway:
            prom = prometheus_factory([gateway.url.removeprefix("http://")])
            # Prometheus applies its targets a few seconds after start (service discovery updates are batched)
            wait_until(lambda: preview.api(prom.url, "/api/v1/query", {"query": 'up{job="gateway"} == 1'})["result"],
                       "prometheus scraped the gateway", within=15)
            gone = fleet.fleet["gone"]
            wait_until(lambda: "m-gone" in {m["id"] for m in httpx.get(gateway.url + "/v1/models").json()["data"]},
                       "models discovered")
            fleet.call(gone.stop())  # a backend that dies: down, scrape errors, failed requests, 503s

            # at least one structured answer retried before the load (routing may pick either backend)
            client, rng = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0), random.Random(0)
            for _ in range(40):
                structured(client, rng)
                if "gateway_retries_total{" in httpx.get(gateway.url + "/metrics").text:
                    break
            else:
                raise AssertionError("40 structured requests and none routed to the misconfigured backend")
            # and one answer passed unchecked: an $anchor below the root is not followed by the check's count
            unfollowed = {"type": "object", "properties": {"name": {"$anchor": "n", "type": "string"}}}
            for _ in range(20):
                with contextlib.suppress(openai.APIError):  # (the misconfigured backend's answer is not JSON)
                    client.chat.completions.create(
                        model="shared", messages=[{"role": "user", "content": f"{rng.random()}: a person"}],
                        max_tokens=30,
                        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": unfollowed}})
                if "gateway_structured_output_unchecked_total{" in httpx.get(gateway.url + "/metrics").text:
                    break
            else:
                raise AssertionError("20 requests with a schema that cannot be checked and none passed unchecked")

            load_start = time.time()
            until = time.monotonic() + LOAD_SECONDS
            with ThreadPoolExecutor(4) as pool:
                for future in [pool.submit(drive, gateway.url, until) for _ in range(4)]:
                    future.result()
            # the last scrapes and rule evaluations: a scrape of the gateway after the load, then every rule group
            # evaluated twice since (a rule reading another group's series sees it)
            load_done = time.time()

            def scraped_after() -> float | None:
                scrapes = [instant(t["lastScrape"]) for t in preview.api(prom.url, "/api/v1/targets", {})[
                    "activeTargets"]]
                return scrapes[0] if scrapes and scrapes[0] > load_done else None

            wait_until(scraped_after, "a scrape of the gateway after the load")
            scraped = scraped_after()
            assert scraped is not None
            wait_until(lambda: evaluated_after(preview, prom, scraped), "the rules evaluated after the last scrape")
            once = evaluated_after(preview, prom, scraped)
            assert once is not None
            wait_until(lambda: evaluated_after(preview, prom, once), "the rules evaluated once more")
            load_end = evaluated_after(preview, prom, once)  # (Prometheus's time of that evaluation)
            assert load_end is not None

            variables = preview.variable_defaults(board)
            empty: list[str] = []
            queried = 0
            for panel in preview.panels(board):
                for target in panel.targets:
                    expr = preview.substitute(target.expr, variables, RATE_INTERVAL)
                    result = preview.api(prom.url, "/api/v1/query", {"query": expr, "time": f"{load_end:.3f}"})
                    values = [float(r["value"][1]) for r in result["result"]]
                    queried += 1
                    if not any(math.isfinite(v) for v in values):
                        empty.append(f"{panel.row} / {panel.title}: {expr} -> {result['result']}")
            assert queried >= 40
            targets = preview.api(prom.url, "/api/v1/targets", {})["activeTargets"]
            assert not empty, ("panel queries without data:\n" + "\n".join(empty)
                               + f"\ntargets: {[(t['health'], t['lastError']) for t in targets]}")

            for var in board["templating"]["list"]:
                if var["type"] != "query":
                    continue
                metric, label = var["query"]["query"].removeprefix("label_values(").rstrip(")").split(", ")
                values = httpx.get(f"{prom.url}/api/v1/label/{label}/values", params={"match[]": metric}).json()
                assert values["data"], f"variable {var['name']}: no values"

            groups = preview.api(prom.url, "/api/v1/rules", {})["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            assert len(rules) == len([r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]])
            for rule in rules:
                assert rule["health"] == "ok", rule
                if rule["type"] == "recording":
                    result = preview.api(prom.url, "/api/v1/query", {"query": rule["name"]})["result"]
                    assert result, f"recording rule {rule['name']} has no data"

            results = preview.collect(prom.url, board, load_start - 2, load_end, 1.0, RATE_INTERVAL)
            preview.render(results, PREVIEW, title=f"{board['title']}: {LOAD_SECONDS:.0f} s of emulated load "
                           f"(rate interval {RATE_INTERVAL})")
    assert PREVIEW.stat().st_size > 10_000
    assert DASHBOARD_JSON.exists()
