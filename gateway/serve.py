"""Run the gateway under uvicorn (uvloop + httptools): configured by a file, or in front of an emulated fleet
that the command line started (``gateway.sim.embedded``; the gateway never imports the emulators)."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence

import uvicorn

from gateway.app import create_app
from gateway.config import Settings, load_settings, settings_from_mapping
from gateway.routing.policies import check_settings
from gateway.server_limits import raise_nofile_limit, uvicorn_config


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


def serve(config_path: str | None, *, host: str | None, port: int | None, log_level: str,
          emulated: Sequence[Mapping[str, str]] = ()) -> int:
    """Serve until SIGINT or SIGTERM: the gateway configured by ``config_path`` or, without one, in front of
    ``emulated``: the backends (``name``, ``engine``, ``url``) of an emulated fleet that the caller started and
    keeps running meanwhile. ``host`` and ``port`` override the configured listen address."""
    server_overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if config_path is not None:
        settings = load_settings(config_path)
        if server_overrides:
            settings = settings.model_copy(update={"server": settings.server.model_copy(update=server_overrides)})
        check_settings(settings)
        _run(settings, log_level)
        return 0
    settings = settings_from_mapping({"server": server_overrides, "backends": [dict(b) for b in emulated]})
    check_settings(settings)
    print(
        "No --config given: the gateway is serving an EMULATED fleet, not real models:\n"
        + "\n".join(f"  {b.name:<16} {b.engine:<9} {b.url}" for b in settings.backends)
        + f"\nOpenAI base URL: http://{settings.server.host}:{settings.server.port}/v1",
        flush=True,
    )
    _run(settings, log_level)
    return 0
