"""The status page (``/ui`` on the admin listener) in a real browser: Debian's headless Chromium, driven over the
DevTools protocol, in front of a `gateway serve` process and emulated engines. It renders the fleet and the
models, its numbers move under load, and its drain button drains (the gateway then routes nothing new to that
backend). The test leaves a screenshot at reports/status-page.png."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.sim import FleetThread, SimSpec
from tests.conftest import free_port
from tests.files import write_config
from tests.test_admin_listener import wait_ready
from tests.ui.cdp import Browser, chromium_path
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "reports" / "status-page.png"
CHROMIUM = chromium_path()
OPS_KEY = "sk-ops-4567"

pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (scripts/test installs it)"),
              pytest.mark.system]


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    specs = [SimSpec(engine="vllm", model="m", name="va", time_scale=4.0),
             SimSpec(engine="sglang", model="m", name="sg", time_scale=4.0),
             SimSpec(engine="tabbyapi", model="m-canary", name="tb", time_scale=4.0)]
    with FleetThread(specs) as running:
        yield running


class Load:
    """Streams through the gateway from a few threads until stopped; counts what each backend served."""

    def __init__(self, url: str, threads: int = 6) -> None:
        self.url = url
        self.served: dict[str, int] = {}
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30, headers={"authorization": f"Bearer {OPS_KEY}"}) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    self._one(client, i, n)
                except httpx.HTTPError as exc:
                    with self._lock:
                        self.failed.append(repr(exc))

    def _one(self, client: httpx.Client, i: int, n: int) -> None:
        body = {"model": "chat", "max_tokens": 24, "stream": True,
                "messages": [{"role": "user", "content": f"{i * 7919 + n:x} is the question's number"}]}
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"x-session-id": f"s{i}-{n}"}) as response:
            text = response.read().decode()
            backend = response.headers.get("x-gateway-backend", "?")
        with self._lock:
            if response.status_code != 200 or not text.rstrip().endswith("data: [DONE]"):
                self.failed.append(f"{response.status_code} {text[:200]}")
            self.served[backend] = self.served.get(backend, 0) + 1

    def report(self) -> str:
        with self._lock:
            return f"served {self.served}, failed {len(self.failed)}: {self.failed[:3]}"

    def count(self, backend: str) -> int:
        with self._lock:
            return self.served.get(backend, 0)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def serve(tmp: Path, raw: dict[str, Any]) -> subprocess.Popen[bytes]:
    """`gateway serve` with ``raw`` as its configuration, its output (an access-log line per request) in a file."""
    write_config(tmp / "gateway.yaml", yaml.safe_dump(raw))
    with (tmp / "gateway.log").open("wb") as log:
        return subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(tmp / "gateway.yaml")],
                                stdout=log, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def probe(admin: str, main: str) -> str:
    """Whether the gateway answers at all (for a failure's message)."""
    out = []
    for url in (admin + "/admin/status", main + "/health"):
        try:
            reply = httpx.get(url, timeout=3, headers={"authorization": f"Bearer {OPS_KEY}"})
            out.append(f"{url}: {reply.status_code}")
        except httpx.HTTPError as exc:
            out.append(f"{url}: {exc!r}")
    return " ".join(out)


def card(name: str, field: str) -> str:
    return f"document.querySelector('[data-backend=\"{name}\"] [data-field=\"{field}\"]')?.textContent"


def test_the_status_page_shows_the_fleet_moves_under_load_and_drains(fleet: FleetThread, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    port, admin_port = free_port(), free_port()
    servers = {s.spec.name: s.url for s in fleet.fleet.servers}
    proc = serve(tmp_path, {
        "server": {"port": port, "admin_port": admin_port},
        "scrape": {"interval": 0.2},
        "backends": [{"name": "va", "engine": "vllm", "url": servers["va"]},
                     {"name": "sg", "engine": "sglang", "url": servers["sg"]},
                     {"name": "tb", "engine": "tabbyapi", "url": servers["tb"]}],
        "models": {"chat": {"targets": [{"model": "m", "weight": 9}, {"model": "m-canary", "weight": 1}],
                            "fallbacks": ["m"]}},
        "auth": {"keys": [{"name": "ops", "key_sha256": hashlib.sha256(OPS_KEY.encode()).hexdigest(),
                           "scopes": ["admin", "inference"]}]}})
    main, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(proc, main)
        with Browser(CHROMIUM) as browser:
            browser.goto(admin + "/ui")
            # the page holds no data without the admin key: it asks for one
            browser.wait_for("!document.getElementById('login').hidden")
            browser.eval(f"document.getElementById('key').value = '{OPS_KEY}'")
            browser.click("#login button")
            browser.wait_for("document.body.dataset.loaded === 'true'")
            # the fleet: every backend, its engine and state; the models, the alias with its split
            names = browser.eval("[...document.querySelectorAll('[data-backend]')].map(e => e.dataset.backend)")
            assert sorted(names) == ["sg", "tb", "va"]
            assert browser.eval(card("va", "engine")) == "vllm"
            browser.wait_for(f"{card('va', 'state')} === 'serving' && {card('tb', 'state')} === 'serving'")
            models = browser.eval("document.getElementById('models').innerText")
            assert "chat" in models and "m 90%" in models and "m-canary 10%" in models
            assert browser.eval(card("va", "requests")) == "0"

            with Load(main) as load:
                # numbers change under load: requests, TTFT and tokens/s on the cards, the sparklines (on the
                # backend serving the most of them: the router picks, va or sg)
                browser.wait_for(f"Number({card('va', 'requests')}) + Number({card('sg', 'requests')}) > 20",
                                 context=load.report)
                busy, other = (("va", "sg") if int(browser.eval(card("va", "requests")))
                               >= int(browser.eval(card("sg", "requests"))) else ("sg", "va"))
                on = f"[data-backend=\"{busy}\"]"
                browser.wait_for(f"{card(busy, 'ttft')} !== '\u2013' && Number({card(busy, 'tokens_per_second')}) > 0",
                                 context=load.report)
                browser.wait_for(f"Number(document.querySelector('{on} [data-spark=\"tokens_per_second\"]')"
                                 ".dataset.max) > 0", context=load.report)
                assert "polyline" in browser.eval(f"document.querySelector('{on} [data-spark=\"ttft_ms\"]').innerHTML")
                assert browser.wait_for("document.getElementById('decisions').children.length") >= 1

                # the drain button drains: the gateway says so, and routes nothing new to it
                button = f"document.querySelector('{on} [data-action=\"drain\"]').textContent"
                assert browser.eval(button) == "Drain"
                drained = f"['draining', 'drained'].includes({card(busy, 'state')})"
                browser.click(f'{on} [data-action="drain"]')
                browser.wait_for(drained, context=lambda: f"the page's requests still open: "
                                 f"{browser.pending_requests()}; {probe(admin, main)}; {load.report()}")
                state = httpx.get(f"{admin}/admin/backends/{busy}", headers={"authorization": f"Bearer {OPS_KEY}"})
                assert state.json()["drained"] is True
                browser.wait_for(f"{card(busy, 'state')} === 'drained'")
                before, others = load.count(busy), load.count(other)
                try:
                    wait_until(lambda: load.count(other) >= others + 10, f"10 requests to {other} after the drain",
                               within=20)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}: {load.report()}") from None
                assert load.count(busy) == before, "a request went to the drained backend"
                assert browser.eval(button) == "Undrain"
                # one more refresh, for the picture (each successful one sets the body's data-loaded)
                browser.eval("document.body.dataset.loaded = 'again'")
                browser.wait_for("document.body.dataset.loaded === 'true'")
                browser.screenshot(SCREENSHOT)
            assert not load.failed, load.failed[:3]
            assert browser.console_errors() == []
    finally:
        stop(proc)
    assert SCREENSHOT.stat().st_size > 10_000


def test_the_status_page_files_and_the_admin_listener_guards(fleet: FleetThread, tmp_path: Path) -> None:
    """The page's files carry a strict CSP and need no key; the admin listener trusting its address answers only
    requests sent to an address or localhost (no DNS rebinding), and takes no change from another origin."""
    port, admin_port = free_port(), free_port()
    proc = serve(tmp_path, {
        "server": {"port": port, "admin_port": admin_port},
        "backends": [{"name": "va", "engine": "vllm", "url": fleet.fleet.servers[0].url}]})
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        page = httpx.get(admin + "/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert "<script src=\"/ui/ui.js\"" in page.text
        assert httpx.get(admin + "/ui/ui.js").headers["content-type"].startswith("text/javascript")
        assert httpx.get(admin + "/ui/ui.css").headers["content-type"].startswith("text/css")
        assert httpx.get(admin + "/admin/status").json()["backends"][0]["name"] == "va"
        rebound = httpx.get(admin + "/admin/status", headers={"host": f"evil.example:{admin_port}"})
        assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "admin_host_refused"
        assert httpx.get(f"http://localhost:{admin_port}/admin/status").status_code == 200
        cross = httpx.post(admin + "/admin/backends/va/drain", headers={"origin": "http://evil.example"})
        assert cross.status_code == 403 and cross.json()["error"]["code"] == "cross_origin_refused"
        same = httpx.post(admin + "/admin/backends/va/drain", headers={"origin": admin})
        assert same.status_code == 200 and same.json()["drained"] is True
        assert httpx.post(admin + "/admin/backends/va/undrain").json()["state"] == "serving"
    finally:
        stop(proc)
