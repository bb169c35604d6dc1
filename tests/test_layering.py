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
_CHILD = "import importlib, json, sys; importlib.import_module(sys.argv[1]); print(json.dumps(sorted(sys.modules)))"


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


def _import_alone(module: str) -> tuple[str, set[str] | str]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, module], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if proc.returncode != 0:
        return module, proc.stderr[-2000:]
    return module, set(json.loads(proc.stdout))


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """Module -> what importing it alone, in a fresh interpreter, loads."""
    modules = sorted(product_modules())
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        results = dict(pool.map(_import_alone, modules))
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
