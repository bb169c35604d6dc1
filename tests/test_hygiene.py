"""The suite waits for events, not durations, and asserts behaviour, not wall-clock time (docs/development.md,
"Tiers, and time"): read from the test sources themselves.

- A ``sleep`` of a non-zero duration (``time``, ``asyncio``, ``anyio``) is allowed only where the behaviour under
  test is itself a real-time one, said in a ``# real time: why`` comment on its line or the line above, or where
  it moves a fake-time loop's clock (no real time passes), said in a ``# fake time: what passes`` comment. To
  wait for a state, wait for its event, or use ``tests.waiting`` (the one bounded helper).
- An ``assert`` on a clock reading (``time.monotonic()``, ``perf_counter()``, ``time()``, a name computed from
  one) likewise: a deadline is ``tests.waiting``'s business, and a duration belongs in ``gateway bench``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
MARKERS = ("real time:", "fake time:")
HELPER = TESTS / "waiting.py"
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}
SLEEPS = {"sleep"}


def _called(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute):
            return func.attr
        if isinstance(func, ast.Name):
            return func.id
    return None


def _reads_clock(node: ast.AST, clocked: set[str]) -> bool:
    for sub in ast.walk(node):
        if _called(sub) in CLOCKS and isinstance(sub, ast.Call) and not sub.args:
            return True
        if isinstance(sub, ast.Name) and sub.id in clocked:
            return True
    return False


def _marked(lines: list[str], node: ast.AST) -> bool:
    first = node.lineno - 1
    last = getattr(node, "end_lineno", node.lineno) - 1
    window = lines[max(0, first - 1):last + 1]
    return any(marker in line for line in window for marker in MARKERS)


def _zero(arg: ast.expr) -> bool:
    return isinstance(arg, ast.Constant) and arg.value == 0


def offences(path: Path, root: Path = TESTS.parent) -> list[str]:
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    found: list[str] = []
    for scope in ast.walk(tree):
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        body = list(ast.walk(scope))
        # names a clock reading flows into (a start time, a deadline, a duration), in this scope
        clocked: set[str] = set()
        for node in body:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None \
                    and _reads_clock(node.value, clocked):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            clocked.add(name.id)
        for node in body:
            if isinstance(node, ast.Assert) and _reads_clock(node.test, clocked) and not _marked(lines, node):
                found.append(f"{path.relative_to(root)}:{node.lineno}: asserts on the clock")
    for node in ast.walk(tree):
        if _called(node) in SLEEPS and isinstance(node, ast.Call) and node.args and not _zero(node.args[0]) \
                and not _marked(lines, node):
            found.append(f"{path.relative_to(root)}:{node.lineno}: sleeps")
    return sorted(set(found), key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_no_test_sleeps_to_synchronise_or_asserts_a_duration() -> None:
    found = [f for path in sorted(TESTS.rglob("*.py")) if path != HELPER for f in offences(path)]
    assert not found, "\n".join(found)


def test_the_check_sees_what_it_forbids(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import asyncio, time\n"
        "async def f():\n"
        "    await asyncio.sleep(0.3)\n"
        "    await asyncio.sleep(0)\n"
        "    # real time: the engine's answer is slow, as the breaker must see\n"
        "    await asyncio.sleep(1)\n"
        "    await asyncio.sleep(30)  # fake time: the deadline passing\n"
        "    started = time.monotonic()\n"
        "    took = time.monotonic() - started\n"
        "    assert took < 0.2\n"
        "    assert time.perf_counter() > 0  # real time: what is said here\n")
    assert offences(sample, tmp_path) == ["sample.py:3: sleeps", "sample.py:10: asserts on the clock"]
