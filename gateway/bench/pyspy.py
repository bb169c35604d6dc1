"""Sample a running process with py-spy and rank where its time goes.

``py-spy record -p PID -f raw`` writes collapsed stacks: one line per distinct stack,
``frame;frame;...;frame COUNT``, outermost first, each frame ``function (file:line)``. :func:`top_frames` folds
line numbers away and ranks functions by *self* samples (the frame on top of the stack) and by *total*
samples (the frame anywhere in the stack, counted once per stack).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_LINE = re.compile(r":\d+\)$")


@dataclass(frozen=True)
class FrameCost:
    frame: str
    self_samples: int
    total_samples: int
    self_share: float
    total_share: float


def _frame_key(frame: str) -> str:
    frame = _LINE.sub(")", frame.strip())
    # shorten absolute paths to what follows site-packages/ or the repository root
    for marker in ("site-packages/", "/gateway/", "lib/python3."):
        i = frame.find(marker)
        if i >= 0:
            head = frame[: frame.find("(") + 1]
            tail = frame[i + len(marker):] if marker != "/gateway/" else "gateway/" + frame[i + len(marker):]
            if marker == "lib/python3.":
                tail = "stdlib/" + tail.split("/", 1)[-1]
            return head + tail
    return frame


def parse_collapsed(text: str) -> tuple[Counter[str], Counter[str], int]:
    """(self samples, total samples, all samples) per function from collapsed-stack text."""
    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    n = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [_frame_key(f) for f in stack.split(";") if f]
        if not frames:
            continue
        n += k
        self_c[frames[-1]] += k
        for f in set(frames):
            total_c[f] += k
    return self_c, total_c, n


def top_frames(text: str, limit: int = 25, by: str = "self") -> list[FrameCost]:
    self_c, total_c, n = parse_collapsed(text)
    ranking = self_c if by == "self" else total_c
    return [FrameCost(frame, self_c[frame], total_c[frame], self_c[frame] / n if n else 0.0,
                      total_c[frame] / n if n else 0.0) for frame, _ in ranking.most_common(limit)]


def _area(frame: str) -> str:
    """The package (two path levels: ``redis/asyncio``, ``gateway/state``, ``stdlib/asyncio``) of a folded frame
    ``function (path)``; the frame itself when it names no file (py-spy's native or idle frames)."""
    open_at = frame.rfind("(")
    if open_at < 0 or not frame.endswith(")"):
        return frame
    parts = frame[open_at + 1:-1].split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def top_areas(text: str, limit: int = 15) -> list[tuple[str, int, float]]:
    """Self samples by package (see :func:`_area`), most first: (area, samples, share). Two profiles' areas side
    by side say which code a feature's cost lives in, even when it is spread thin over many functions."""
    self_c, _, n = parse_collapsed(text)
    areas: Counter[str] = Counter()
    for frame, k in self_c.items():
        areas[_area(frame)] += k
    return [(area, k, k / n if n else 0.0) for area, k in areas.most_common(limit)]


def py_spy_binary() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def start_record(pid: int, seconds: float, out: Path, rate: int = 200) -> subprocess.Popen[bytes] | None:
    """Start ``py-spy record`` on ``pid`` for ``seconds`` (non-blocking sampling); None without py-spy."""
    binary = py_spy_binary()
    if binary is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [binary, "record", "-p", str(pid), "-f", "raw", "-o", str(out), "-d", str(max(1, round(seconds))),
           "-r", str(rate), "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
