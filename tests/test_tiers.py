"""The tiers hold: a test doing what its tier forbids fails naming the tier it belongs in, whether it does it in
its own thread, in a thread it starts, or through a fixture; and --tier runs one tier (tests/tiers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.system  # (it runs pytest in a process of its own)

ROOT = Path(__file__).resolve().parents[1]

CASES = '''
import socket, subprocess, threading, time
import pytest

def touch_network():
    with socket.socket() as s:
        s.connect_ex(("127.0.0.1", 9))

@pytest.fixture(scope="module")
def server():
    thread = threading.Thread(target=lambda: socket.socket().bind(("127.0.0.1", 0)))
    thread.start()
    thread.join()

@pytest.mark.unit
def test_unit_network():
    touch_network()

@pytest.mark.unit
def test_unit_sleeps():
    time.sleep(0.001)

@pytest.mark.unit
def test_unit_thread_starts_a_process():
    thread = threading.Thread(target=lambda: subprocess.run(["true"]))
    thread.start()
    thread.join()

@pytest.mark.unit
def test_unit_uses_a_server(server):
    pass

def test_integration_network():
    touch_network()

def test_integration_process():
    subprocess.run(["true"])

@pytest.mark.system
def test_system_process():
    subprocess.run(["true"])

@pytest.mark.unit
def test_unit_computes():
    assert sum(range(4)) == 6
'''


def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_cases=CASES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return pytester.runpytest_subprocess("-p", "tests.tiers", "-p", "no:looptime_plugin", "-p", "no:cacheprovider",
                                         "-rA", *args)


def test_a_test_doing_what_its_tier_forbids_fails_naming_its_tier(pytester: pytest.Pytester,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(pytester, monkeypatch)
    text = result.stdout.str()
    failed = {line.split("::")[1].split(" ")[0] for line in text.splitlines()
              if line.startswith(("FAILED", "ERROR")) and "::" in line}
    assert failed == {"test_unit_network", "test_unit_sleeps", "test_unit_thread_starts_a_process",
                      "test_unit_uses_a_server", "test_integration_process"}, text
    assert "belongs in the integration tier" in text and "belongs in the system tier" in text
    for passing in ("test_integration_network", "test_system_process", "test_unit_computes"):
        assert f"PASSED test_cases.py::{passing}" in text, text


def test_one_tier_runs_alone(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result = run(pytester, monkeypatch, "--tier", "system")
    result.assert_outcomes(passed=1, deselected=7)
