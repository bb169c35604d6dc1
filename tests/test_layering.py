"""The product does not stand on its tooling, and routing does not stand on HTTP.

Checked by what actually gets loaded: every product module is imported in a fresh interpreter of its own
(modules imported one after another in one interpreter would hide each other's imports), and that
interpreter's ``sys.modules`` must hold nothing from the emulators, the benchmarks or the llama.cpp helpers.
A static check adds what a fresh import cannot see: an import inside a function that has not run yet.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gateway"
TOOLING = ("gateway.sim", "gateway.bench", "gateway.llamacpp")
# the composition root may reach tooling (lazily: ``gateway sim``, ``gateway bench``, the embedded fleet)
COMPOSITION_ROOT = ("gateway.cli", "gateway.__main__")
HTTP_FRAMEWORKS = frozenset({"fastapi", "starlette", "httpx", "aiohttp", "uvicorn"})
# Third-party packages loaded once, before the fork that imports each module: none is tooling or HTTP code (the
# fixture checks), so what a module loads beyond them is what it loads in a fresh interpreter. An interpreter of
# its own per module paid for them ~200 times over.
PRELOAD = ("asyncio", "ssl", "subprocess", "pydantic", "pydantic_core", "pydantic_settings", "yaml", "jinja2",
           "prometheus_client", "zmq", "zmq.asyncio", "tenacity", "tokenizers", "msgspec", "orjson", "click",
           "opentelemetry.trace", "opentelemetry.sdk.trace")
_ZYGOTE = """
import importlib, json, os, sys, traceback
for name in sys.argv[1].split(","):
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)), flush=True)
for module in sys.argv[2:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            out = json.dumps(sorted(sys.modules))
        except BaseException:
            out = json.dumps(traceback.format_exc()[-2000:])
        data = out.encode()
        while data:
            data = data[os.write(write, data):]
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    print(json.dumps([module, json.loads(answer)]), flush=True)
"""


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules() -> dict[str, Path]:
    """Every module under gateway/ but the tooling and the composition root."""
    found = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: path for name, path in found.items()
            if not _under(name, TOOLING) and not _under(name, COMPOSITION_ROOT)}


def _import_each_alone(modules: list[str]) -> tuple[set[str], dict[str, set[str] | str]]:
    """What the preload loads, and per module what importing it alone after the preload loads (or why it failed):
    one interpreter loads the preload, then forks a child per module."""
    proc = subprocess.run([sys.executable, "-c", _ZYGOTE, ",".join(PRELOAD), *modules], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    results: dict[str, set[str] | str] = {}
    for line in lines[1:]:
        module, loaded = json.loads(line)
        results[module] = set(loaded) if isinstance(loaded, list) else loaded
    return set(json.loads(lines[0])), results


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """Module -> what importing it alone, in a fresh interpreter (but for the preload), loads."""
    modules = sorted(product_modules())
    halves = [modules[0::2], modules[1::2]]  # (two interpreters: the machines have two cores)
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = list(pool.map(_import_each_alone, halves))
    results: dict[str, set[str] | str] = {}
    for preloaded, found in answers:
        hidden = {n for n in preloaded if _under(n, ("gateway",)) or n.split(".")[0] in HTTP_FRAMEWORKS}
        assert not hidden, f"the preload loads what the checks look for: {sorted(hidden)}"
        results.update(found)
    assert sorted(results) == modules
    failed = {m: r for m, r in results.items() if isinstance(r, str)}
    assert not failed, f"these product modules do not import on their own: {failed}"
    return {m: r for m, r in results.items() if isinstance(r, set)}


def test_the_check_covers_the_product() -> None:
    modules = product_modules()
    assert len(modules) > 60
    assert {"gateway.app", "gateway.serve", "gateway.routing.pipeline", "gateway.structured.syntax",
            "gateway.engines.llamacpp"} <= modules.keys()
    assert not any(_under(m, TOOLING + COMPOSITION_ROOT) for m in modules)


@pytest.mark.system
def test_no_product_module_loads_tooling(loaded: dict[str, set[str]]) -> None:
    offenders = {m: sorted(n for n in names if _under(n, TOOLING)) for m, names in loaded.items()}
    assert {m: names for m, names in offenders.items() if names} == {}


@pytest.mark.system
def test_routing_loads_no_http_or_framework_code(loaded: dict[str, set[str]]) -> None:
    routing = {m: names for m, names in loaded.items() if _under(m, ("gateway.routing",))}
    assert len(routing) > 10
    offenders = {m: sorted({n.split(".")[0] for n in names} & HTTP_FRAMEWORKS) for m, names in routing.items()}
    assert {m: names for m, names in offenders.items() if names} == {}


def _imported_names(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """Every module name an import statement (at any depth) or an ``import_module("...")`` call names."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            yield node.lineno, base
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def test_no_product_module_names_tooling_in_an_import() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name}"
                 for module, path in product_modules().items()
                 for line, name in _imported_names(module, path) if _under(name, TOOLING)]
    assert offenders == []


def test_the_static_check_sees_relative_and_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "__init__.py"
    source.write_text("def f():\n    from ..sim import fleet\n    importlib.import_module('gateway.bench.cli')\n")
    names = {name for _, name in _imported_names("gateway.serve_x", source)}
    assert {"gateway.sim", "gateway.sim.fleet", "gateway.bench.cli"} <= names
