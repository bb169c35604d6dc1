"""The serving process's collector settings (gateway.gcpolicy), in a process of its own: they are global."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway import gcpolicy

pytestmark = pytest.mark.system


def test_quiet_freezes_what_startup_made_and_raises_the_thresholds() -> None:
    code = ("import gc, json; from gateway import gcpolicy; before = gc.get_freeze_count(); gcpolicy.quiet(); "
            "print(json.dumps([before, gc.get_freeze_count(), gc.get_threshold(), gc.isenabled()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after, threshold, enabled = json.loads(out.stdout)
    assert before == 0 and after > 1000  # the interpreter's and the gateway's modules, no longer walked
    assert threshold == [gcpolicy.GEN0, gcpolicy.GEN1, gcpolicy.GEN2] and gcpolicy.GEN0 > 700
    assert enabled  # cycles are still collected, in fewer batches


def test_quieted_gives_the_settings_back() -> None:
    code = ("import gc, json; from gateway import gcpolicy; t = gc.get_threshold()\n"
            "with gcpolicy.quieted(): inside = [gc.get_threshold(), gc.get_freeze_count() > 0]\n"
            "print(json.dumps([list(t), inside, list(gc.get_threshold()), gc.get_freeze_count()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, inside, after, frozen = json.loads(out.stdout)
    assert inside == [[gcpolicy.GEN0, gcpolicy.GEN1, gcpolicy.GEN2], True]
    assert after == before and frozen == 0
