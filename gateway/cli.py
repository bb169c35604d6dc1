"""Command line: parse arguments, build settings, hand over. No logic of its own.

    gateway serve [--config FILE] [--host HOST] [--port PORT]
    gateway check-config FILE
    gateway sim ...            (the engine emulators; see ``gateway sim --help``)
    gateway llamacpp ...       (a real llama-server on this CPU; see ``gateway llamacpp --help``)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys

from gateway.config import ConfigError, load_settings
from gateway.routing.policies import check_settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="Multi-engine LLM gateway")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", help="YAML configuration; without it, an emulated fleet is started and used")
    serve.add_argument("--host", help="listen address (overrides server.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides server.port)")
    serve.add_argument("--admin-port", type=int,
                       help="the admin listener's port, with the status page at /ui (overrides server.admin_port; "
                            "without --config and --port it is 8001)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--sim-base-port", type=int, default=18001,
                       help="without --config: first port of the emulated fleet (default 18001)")

    check = sub.add_parser("check-config", help="validate a configuration file without starting")
    check.add_argument("file")

    sub.add_parser("sim", help="run emulated engines (llama.cpp, vLLM, SGLang, TabbyAPI)", add_help=False)
    sub.add_parser("llamacpp", help="build and run a real llama.cpp server on this CPU", add_help=False)
    sub.add_parser("bench", help="load-generate against OpenAI-compatible endpoints and compare them",
                   add_help=False)
    sub.add_parser("profile", help="measure each backend's speed curve over concurrency", add_help=False)
    return parser


# The optional extras (pyproject.toml's [project.optional-dependencies]) by the top-level modules they bring.
# The tools import them lazily, where they are used, so a missing one surfaces at the command boundary below.
_EXTRA_OF_MODULE = {"gguf": "llamacpp", "numpy": "llamacpp", "rich": "bench", "matplotlib": "bench"}


def _missing_extra(args: list[str], exc: ModuleNotFoundError) -> int:
    """One line naming the command, the extra and the missing module (exit 2); re-raise any other import error."""
    module = (exc.name or "").partition(".")[0]
    extra = _EXTRA_OF_MODULE.get(module)
    if extra is None:
        raise exc
    words = list(itertools.takewhile(lambda a: not a.startswith("-"), args))[:3]
    print(f"error: '{' '.join(['gateway', *words])}' needs the {extra} extra (no module named {module!r}): "
          f"pip install 'llm-gateway[{extra}]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    try:
        if args_list[:1] in (["bench"], ["profile"]):
            from gateway.bench.cli import main as bench_main

            return bench_main(args_list)
        if args_list[:1] == ["llamacpp"]:
            from gateway.llamacpp.cli import main as llamacpp_main

            return llamacpp_main(args_list[1:])
    except ModuleNotFoundError as exc:
        return _missing_extra(args_list, exc)
    if args_list[:1] == ["sim"]:
        from gateway.sim.cli import main as sim_main

        code: int = sim_main(args_list[1:])
        return code
    args = _parser().parse_args(args_list)
    if args.command == "check-config":
        try:
            settings = load_settings(args.file)
            check_settings(settings)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        names = ", ".join(f"{b.name} ({b.engine})" for b in settings.backends) or "none"
        print(f"{args.file}: OK; backends: {names}; routing policy: {settings.routing.policy}")
        return 0
    from gateway.serve import configure_logging, serve

    configure_logging(args.log_level)
    # without a configuration, the emulated fleet: tooling, which only this composition root may reach
    fleet: contextlib.AbstractContextManager[list[dict[str, str]]] = contextlib.nullcontext([])
    errors: tuple[type[Exception], ...] = (ConfigError,)
    if args.config is None:
        from gateway.sim.embedded import FleetStartError, embedded_fleet

        fleet, errors = embedded_fleet(args.sim_base_port), (ConfigError, FleetStartError)
    try:
        with fleet as emulated:
            return serve(args.config, host=args.host, port=args.port, admin_port=args.admin_port,
                         log_level=args.log_level, emulated=emulated)
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
