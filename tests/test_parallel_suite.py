"""The suite runs in several processes (scripts/test, pytest-xdist): what they share must be made once and
never taken twice. The cache's files are made under a lock and moved into place from a path of their own; each
process picks its port blocks in its own range."""

from __future__ import annotations

import fcntl
import itertools
import threading
from pathlib import Path

import pytest

from gateway.llamacpp import build as build_module
from gateway.llamacpp.build import cache_lock, staging_path
from tests.conftest import _port_range

pytestmark = pytest.mark.unit


def test_a_cache_lock_keeps_a_second_holder_waiting_until_the_first_lets_go(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    order: list[str] = []
    first_in, first_may_go = threading.Event(), threading.Event()

    def first() -> None:
        with cache_lock("model"):
            order.append("first in")
            first_in.set()
            first_may_go.wait(10)
            order.append("first out")

    def second() -> None:
        first_in.wait(10)
        with cache_lock("model"):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    assert first_in.wait(10)
    # as another process would try it
    with open(tmp_path / "llm-gateway" / ".model.lock", "a") as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    first_may_go.set()
    for thread in threads:
        thread.join(10)
    assert order == ["first in", "first out", "second in"]


def test_another_lock_name_does_not_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with cache_lock("a"):
        got = threading.Event()
        thread = threading.Thread(target=lambda: (cache_lock("b").__enter__(), got.set()))
        thread.start()
        thread.join(10)
        assert got.is_set()


def test_a_staging_path_is_this_process_own_and_beside_its_target(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m.gguf"
    staging = staging_path(target)
    assert staging.parent == target.parent and staging != target
    assert str(build_module.os.getpid()) in staging.name and staging.name.endswith(".tmp")


@pytest.mark.parametrize("count", [1, 2, 3])
def test_each_process_of_the_suite_picks_ports_in_a_range_of_its_own(
        count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    ranges = []
    for index in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        ranges.append(_port_range(20000, 32000))
    for (low, high), (next_low, _) in itertools.pairwise(ranges):
        assert low < high <= next_low
    assert ranges[0][0] == 20000 and ranges[-1][1] <= 32000
    assert all(high - low >= 12000 // count - 1 for low, high in ranges)


def test_one_process_alone_has_the_whole_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert _port_range(20000, 32000) == (20000, 32000)
