"""llama.cpp's own verdicts, from a real llama-server when one is cached (``gateway llamacpp build``): the
authority on GBNF grammars and JSON schemas for llama.cpp."""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.bench.constraints.corpus import A, Case, R

ORACLE_MAX_RSS = 2 << 30  # a llama-server past this is killed: some grammars make it allocate without end


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ask_llama(server: Any, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One request; the server is killed (and the verdict is a crash) past ORACLE_MAX_RSS or ``timeout``."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, server.url + "/completion", json=body, timeout=timeout + 5)
        deadline, peak = time.monotonic() + timeout, 0
        while not answer.done():
            peak = max(peak, _rss(server.proc.pid))
            if peak > ORACLE_MAX_RSS or time.monotonic() > deadline:
                server.kill()
                why = f"RSS past {ORACLE_MAX_RSS >> 30} GiB" if peak > ORACLE_MAX_RSS else f"no answer in {timeout} s"
                return {"verdict": "crash", "message": f"killed: {why} (still growing)"}
            time.sleep(0.02)
        try:
            r = answer.result()
        except httpx.TransportError as exc:
            return {"verdict": "crash", "message": f"{type(exc).__name__}: {exc}"[:300]}
    return {"verdict": A if r.status_code == 200 else R, "message": "" if r.status_code == 200 else r.text[:300]}


def llama_cpp_verdicts(cases: list[Case], timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """llama-server's verdict on every GBNF grammar (``grammar``) and JSON schema (``json_schema``): a 400 is a
    rejection; a server that dies or runs away is a crash (and a fresh one serves the next)."""
    from gateway.llamacpp.build import binary_path
    from gateway.llamacpp.model import model_path
    from gateway.llamacpp.server import LlamaServer

    wanted = [c for c in cases if c.dialect in ("gbnf", "json_schema")]
    binary = binary_path()
    if not wanted or not binary.exists():
        return {}
    found: dict[str, dict[str, Any]] = {}
    server: Any = None
    try:
        for case in wanted:
            try:
                value: Any = case.text if case.kind == "grammar" else orjson.loads(case.text)
            except orjson.JSONDecodeError:  # deeper than any JSON parser takes: not sent
                continue
            server = server or LlamaServer(binary, model_path("tiny"), _free_port(), slots=1, ctx=512).start()
            field_ = "grammar" if case.kind == "grammar" else "json_schema"
            found[case.id] = _ask_llama(server, {"prompt": "a", "n_predict": 1, field_: value}, timeout)
            if found[case.id]["verdict"] == "crash":
                server.kill()
                server = None
    finally:
        if server is not None:
            server.stop()
    return found
