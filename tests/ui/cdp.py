"""Just enough of the Chrome DevTools Protocol to drive Debian's headless Chromium from a test: start it, open a
page, evaluate JavaScript, click with the mouse, take a screenshot. (websockets' synchronous client; no
Playwright, whose wheel brings its own Node.js driver.)"""

from __future__ import annotations

import base64
import contextlib
import itertools
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
from websockets.sync.client import ClientConnection, connect

from tests.waiting import wait_until

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    for name in CHROMIUM:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class CdpError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with one page (a fresh profile, removed on close)."""

    def __init__(self, executable: str, *, width: int = 1400, height: int = 1000) -> None:
        self._profile = tempfile.mkdtemp(prefix="gateway-chromium-")
        self._stack = contextlib.ExitStack()
        # (its stderr: a pipe nobody reads could fill and stall it)
        self._log = self._stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115 (closed by close())
        self._proc = subprocess.Popen(
            [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=self._log)
        self._ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        try:
            port = self._port()
            pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
                     if t["type"] == "page"]
            self._ws: ClientConnection | None = self._stack.enter_context(
                connect(pages[0]["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024, open_timeout=10))
        except BaseException:
            self.close()
            raise
        for domain in ("Page", "Runtime", "Network"):
            self.send(f"{domain}.enable")

    def _port(self) -> int:
        active = Path(self._profile) / "DevToolsActivePort"
        lines: list[str] = []

        def written() -> bool:
            if self._proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace")
                raise CdpError(f"chromium exited ({self._proc.returncode}): {err[-2000:]}")
            lines[:] = active.read_text().splitlines() if active.exists() else []
            return bool(lines)

        try:
            wait_until(written, "chromium's DevTools port", within=30)
        except AssertionError as exc:
            raise CdpError(str(exc)) from None
        return int(lines[0])

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30) -> dict[str, Any]:
        ident = next(self._ids)
        assert self._ws is not None, "closed"
        self._ws.send(orjson.dumps({"id": ident, "method": method, "params": params or {}}).decode())
        deadline = time.monotonic() + timeout
        while True:
            message = orjson.loads(self._ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if message.get("id") == ident:
                if "error" in message:
                    raise CdpError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result
            self.events.append(message)

    def goto(self, url: str, timeout: float = 20.0) -> None:
        """Open ``url`` and wait until its document has loaded."""
        self.send("Page.navigate", {"url": url})
        target = orjson.dumps(url).decode()
        self.wait_for(f"location.href.startsWith({target}) && document.readyState === 'complete'", timeout)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        reply = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in reply:
            raise CdpError(f"{expression}: {reply['exceptionDetails'].get('exception', reply['exceptionDetails'])}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0, context: Callable[[], str] | None = None) -> Any:
        """Poll until the expression is truthy; its value. ``context``: what to add to the error, if it never is."""
        value: list[Any] = [None]

        def truthy() -> bool:
            value[0] = self.eval(expression)
            return bool(value[0])

        try:
            wait_until(truthy, f"still false: {expression}", within=timeout)
        except AssertionError as exc:
            raise CdpError(str(exc) + (f" ({context()})" if context is not None else "")) from None
        return value[0]

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the middle of the element."""
        box = self.eval(f"(() => {{ const e = document.querySelector({orjson.dumps(selector).decode()});"
                        "e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
                        "return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box["x"], "y": box["y"], "button": "left",
                                                   "clickCount": 1})

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def pending_requests(self) -> list[str]:
        """Requests the page sent that have neither finished nor failed (so far)."""
        sent: dict[str, str] = {}
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Network.requestWillBeSent":
                sent[params["requestId"]] = f"{params['request']['method']} {params['request']['url']}"
            elif method in ("Network.loadingFinished", "Network.loadingFailed"):
                sent.pop(params["requestId"], None)
        return list(sent.values())

    def console_errors(self) -> list[str]:
        """What the page logged as errors or threw, so far."""
        out = []
        for event in self.events:
            if event.get("method") == "Runtime.exceptionThrown":
                out.append(str(event["params"]["exceptionDetails"].get("exception", {}).get("description")))
            elif event.get("method") == "Runtime.consoleAPICalled" and event["params"]["type"] == "error":
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in event["params"]["args"]))
        return out

    def close(self) -> None:
        ws, self._ws = getattr(self, "_ws", None), None
        if ws is not None:
            ws.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._stack.close()
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
