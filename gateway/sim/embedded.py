"""The emulated fleet that ``gateway serve`` without ``--config`` stands in front of: the default fleet (one
server per engine) in a child process, stopped when the context ends. The command line (the composition root)
starts it and hands the backends to the gateway; the gateway itself never imports the emulators."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from gateway.sim.fleet import agent_fleet_specs, default_fleet_specs


class FleetStartError(RuntimeError):
    """The emulated fleet exited, or did not listen on its ports in time."""


def _wait_for_ports(host: str, ports: list[int], proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(ports)
    while pending:
        if proc.poll() is not None:
            raise FleetStartError(f"the emulated fleet exited with status {proc.returncode} (are ports {ports} free?)")
        with socket.socket() as sock:
            sock.settimeout(0.2)
            if sock.connect_ex((host, pending[0])) == 0:
                pending.pop(0)
                continue
        if time.monotonic() > deadline:
            raise FleetStartError(f"the emulated fleet did not start listening on {host}:{pending[0]}")
        time.sleep(0.1)


@contextlib.contextmanager
def embedded_fleet(base_port: int, host: str = "127.0.0.1") -> Iterator[list[dict[str, str]]]:
    """Start the default emulated fleet (and its agent model, ``sim-agent``) in a child process; yield one backend
    per server, as the mapping a configuration file's ``backends`` entry would hold (``name``, ``engine``,
    ``url``)."""
    specs = default_fleet_specs(host=host, base_port=base_port) + agent_fleet_specs(host=host, base_port=base_port)
    cmd = [sys.executable, "-m", "gateway.sim", "fleet", "--default", "--agents", "--host", host,
           "--base-port", str(base_port)]
    proc = subprocess.Popen(cmd)
    try:
        _wait_for_ports(host, [s.port for s in specs], proc)
        yield [{"name": s.name or f"sim-{s.engine}", "engine": s.engine, "url": f"http://{host}:{s.port}"}
               for s in specs]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
