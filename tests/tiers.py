"""The suite's three tiers, and what keeps each one honest (a pytest plugin; tests/conftest.py loads it).

- ``unit``: no sockets on the network (loopback included), no processes, no real sleeping: code driven directly,
  time moved by a fake clock (tests/clock.py, or a fake-time event loop: gateway/clock.py).
- ``integration``: the gateway, emulators and fakes in this process, on loopback sockets; no process started
  (validation workers excepted: multiprocessing's own children are the gateway's).
- ``system``: real programs started as processes: llama-server, Redis, Prometheus, Chromium, valgrind, the
  gateway's own CLI, pip and docker tooling.

A test's tier is its closest tier marker (the test's, else its class's, else its module's ``pytestmark``); a
test with none is ``integration``. What a tier forbids fails the test that did it, naming what it did and the
tier it belongs in, so a marker cannot claim a lighter tier than the test's behaviour: what the test does, in its
own thread or in threads it started, and what the setup of each fixture it uses did (in the setup or in threads
started then: a server thread of a module's fixture binds for every test of the module). ``--tier NAME`` (what
``scripts/test NAME`` passes) runs one tier; ``--tier-record FILE`` instead writes what each test did to FILE
and refuses nothing (how the markers were first chosen).
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import threading
import time
import traceback
from typing import Any

import pytest
import zmq

TIERS = ("unit", "integration", "system")
DEFAULT = "integration"
_TIER = pytest.StashKey[str]()

_current: list[str] = []  # the tier of the test running now (empty between tests)
_seen: dict[str, set[str]] = {}  # test id -> what it did that some tier forbids
_now: list[str] = []  # the id of the test running now
_fixture: list[str] = []  # the fixtures being set up now (their FixtureDefs' keys), innermost last
_by_fixture: dict[str, set[str]] = {}  # fixture -> what its setup did (counted for every test using it)
_record: list[str] = []  # --tier-record's file, when given
_where: dict[tuple[str, str], str] = {}  # (test id, what) -> the other thread that did it for the test, and where

# what each kind of act needs at least
_NEEDS = {"network socket": "integration", "sleep": "integration", "process": "system"}
_RANK = {tier: i for i, tier in enumerate(TIERS)}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tiers")
    group.addoption("--tier", choices=TIERS, help="run the tests of one tier only")
    group.addoption("--tier-record", metavar="FILE",
                    help="write what each test did (network sockets, processes, sleeps) to FILE; refuse nothing")


def pytest_configure(config: pytest.Config) -> None:
    for tier, what in (("unit", "no sockets, no processes, no sleeping: a fake clock"),
                       ("integration", "in-process servers and emulators on loopback"),
                       ("system", "real programs started as processes")):
        config.addinivalue_line("markers", f"{tier}: the {tier} tier ({what}; see tests/tiers.py)")
    if config.getoption("--tier-record"):
        _record.append(config.getoption("--tier-record"))
    _install()


def tier_of(item: pytest.Item) -> str:
    for mark in item.iter_markers():  # (closest first)
        if mark.name in TIERS:
            return mark.name
    return DEFAULT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("--tier")
    keep, drop = [], []
    for item in items:
        tier = item.stash[_TIER] = tier_of(item)
        if not item.get_closest_marker(tier):
            item.add_marker(tier)  # (so -m selects it too)
        (keep if wanted is None or tier == wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _current[:] = [item.stash.get(_TIER, DEFAULT)]
    _now[:] = [item.nodeid]
    try:
        return (yield)
    finally:
        _current.clear()
        _now.clear()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    _fixture.append(_key(fixturedef))
    try:
        return (yield)
    finally:
        _fixture.pop()


def _key(fixturedef: pytest.FixtureDef[Any]) -> str:
    return f"{fixturedef.baseid}::{fixturedef.argname}"  # (one name may be a different fixture per module)


def _done(item: pytest.Item) -> set[str]:
    """What the test did, and what the setup of each fixture it uses did (whichever test set it up first)."""
    done = set(_seen.get(item.nodeid, ()))
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixturedef in defs:  # (an override and what it extends)
            done |= _by_fixture.get(_key(fixturedef), set())
    return done


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if nextitem is None or nextitem.module is not item.module:  # type: ignore[attr-defined]
        # (module and session fixtures end here, what they do is no act of this test's: a session's llama-server
        # stopped after a unit test, the last one run, failed it; a sleep in a session fixture's teardown failed the
        # last unit test of a run of tests/api)
        _current.clear()
        _now.clear()
    result = yield
    done = _done(item)
    tier = item.stash.get(_TIER, DEFAULT)
    wrong = sorted(what for what in done if _RANK[_NEEDS[what]] > _RANK[tier])
    if wrong and not _record:
        needs = max((_NEEDS[w] for w in wrong), key=_RANK.__getitem__)
        where = "; ".join(f"{w}: {_where[item.nodeid, w]}" for w in wrong if (item.nodeid, w) in _where)
        pytest.fail(f"{_a(tier)} test must not start a {' or '.join(wrong)}: it belongs in the {needs} tier "
                    f"(pytest.mark.{needs}; see tests/tiers.py)" + (f" ({where})" if where else ""), pytrace=False)
    return result


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _record:
        with open(_record[0], "w") as out:
            done = {item.nodeid: sorted(_done(item)) for item in session.items}
            json.dump({test: acts for test, acts in sorted(done.items()) if acts}, out, indent=1)


class TierViolation(RuntimeError):
    pass


def _owner() -> tuple[str | None, tuple[str, ...]] | None:
    """Whom the running thread acts for: (the test, the fixtures being set up). The main thread acts for the
    test running now; another thread for whatever was running when it was started (a server thread a fixture
    started acts for that fixture, so for every test using it), or for no one (a thread from before)."""
    thread = threading.current_thread()
    if thread is threading.main_thread():
        return (_now[0], tuple(_fixture)) if _now else None
    owner: tuple[str | None, tuple[str, ...]] | None = getattr(thread, "_tier_owner", None)
    return owner


def _note(what: str) -> None:
    owner = _owner()
    if owner is None:
        return  # (between tests: a session fixture's teardown; or a thread started before this test)
    test, fixtures = owner
    thread = threading.current_thread()
    if test is not None and not fixtures and thread is not threading.main_thread():
        # (named in the failure: another thread's act is found only at teardown)
        frames = traceback.extract_stack(limit=6)[:-2]
        _where.setdefault((test, what), f"thread {thread.name!r} at " + " < ".join(
            f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames)))
    if fixtures:
        for name in fixtures:
            _by_fixture.setdefault(name, set()).add(what)
    elif test is not None:
        _seen.setdefault(test, set()).add(what)
    if (not _record and _current and _RANK[_NEEDS[what]] > _RANK[_current[0]]
            and threading.current_thread() is threading.main_thread()):
        # (raised where it happened in the test's own thread; another thread's is failed at teardown)
        raise TierViolation(f"{_a(_current[0])} test must not start a {what} (see tests/tiers.py)")


def _a(tier: str) -> str:
    return "an integration" if tier == "integration" else f"a {tier}"


def _install() -> None:
    if getattr(socket.socket, "_tiers_installed", False):
        return
    # (Python reads the processor's name with `uname -p` once, for whichever client library asks first: the
    # OpenAI SDK does, for its headers; read it now, so that no test is charged with starting that process)
    platform.processor()
    network = (socket.AF_INET, socket.AF_INET6)

    def guard(name: str) -> None:
        original = getattr(socket.socket, name)

        def checked(self: socket.socket, *args: Any) -> Any:
            if self.family in network:
                _note("network socket")
            return original(self, *args)

        setattr(socket.socket, name, checked)

    for name in ("bind", "connect", "connect_ex"):
        guard(name)
    socket.socket._tiers_installed = True  # type: ignore[attr-defined]

    # ZeroMQ's sockets are its own (KV events): a tcp:// endpoint is the network, inproc:// and ipc:// are not
    for name in ("bind", "connect"):
        original = getattr(zmq.Socket, name)

        def endpoint(self: zmq.Socket[Any], address: str, *args: Any, _original: Any = original) -> Any:
            if str(address).startswith("tcp://"):
                _note("network socket")
            return _original(self, address, *args)

        setattr(zmq.Socket, name, endpoint)

    popen_init = subprocess.Popen.__init__

    def popen(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        _note("process")
        popen_init(self, *args, **kwargs)

    subprocess.Popen.__init__ = popen  # type: ignore[method-assign]

    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if seconds > 0:
            _note("sleep")
        real_sleep(seconds)

    time.sleep = sleep

    thread_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        self._tier_owner = _owner()  # type: ignore[attr-defined]
        thread_start(self)

    threading.Thread.start = start  # type: ignore[method-assign]
