"""Run the gateway under uvicorn (uvloop + httptools), with the embedded emulated fleet when no
configuration is given."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import uvicorn

from gateway.app import create_app
from gateway.config import BackendSettings, ConfigError, Settings, load_settings, settings_from_mapping
from gateway.routing.policies import check_settings
from gateway.server_limits import raise_nofile_limit, uvicorn_config


def _wait_for_ports(host: str, ports: list[int], proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(ports)
    while pending:
        if proc.poll() is not None:
            raise ConfigError(f"the emulated fleet exited with status {proc.returncode} (are ports {ports} free?)")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((host, pending[0])) == 0:
                pending.pop(0)
                continue
        if time.monotonic() > deadline:
            raise ConfigError(f"the emulated fleet did not start listening on {host}:{pending[0]}")
        time.sleep(0.1)


@contextlib.contextmanager
def embedded_fleet(base_port: int, host: str = "127.0.0.1") -> Iterator[list[BackendSettings]]:
    """Start the default emulated fleet (one server per engine) in a child process; yield backend settings."""
    from gateway.sim import default_fleet_specs

    specs = default_fleet_specs(host=host, base_port=base_port)
    cmd = [sys.executable, "-m", "gateway.sim", "fleet", "--default", "--host", host, "--base-port", str(base_port)]
    proc = subprocess.Popen(cmd)
    try:
        _wait_for_ports(host, [s.port for s in specs], proc)
        yield [
            BackendSettings(name=s.name or f"sim-{s.engine}", engine=s.engine, url=f"http://{host}:{s.port}")
            for s in specs
        ]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _run(settings: Settings, log_level: str) -> None:
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal to the handlers that were
    # installed before it. Make those end the process by unwinding, so that every ``finally`` runs (the
    # embedded fleet's child process is stopped) and the exit status is 0.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    raise_nofile_limit()  # before the connection cap is worked out from it
    config = uvicorn_config(create_app(settings), settings.server, log_level=log_level)
    uvicorn.Server(config).run()


def serve(config_path: str | None, *, host: str | None, port: int | None, log_level: str, sim_base_port: int) -> int:
    server_overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if config_path is not None:
        settings = load_settings(config_path)
        if server_overrides:
            settings = settings.model_copy(update={"server": settings.server.model_copy(update=server_overrides)})
        check_settings(settings)
        _run(settings, log_level)
        return 0
    with embedded_fleet(sim_base_port) as backends:
        settings = settings_from_mapping(
            {"server": server_overrides, "backends": [b.model_dump(mode="json", exclude_none=True) for b in backends]}
        )
        check_settings(settings)
        print(
            "No --config given: the gateway is serving an EMULATED fleet, not real models:\n"
            + "\n".join(f"  {b.name:<16} {b.engine:<9} {b.url}" for b in backends)
            + f"\nOpenAI base URL: http://{settings.server.host}:{settings.server.port}/v1",
            flush=True,
        )
        _run(settings, log_level)
    return 0
