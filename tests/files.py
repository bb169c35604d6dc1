"""Configuration files as tests write them for a gateway they start."""

from __future__ import annotations

import os
import time
from pathlib import Path


def write_config(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` as a configuration written a while before the gateway starts, as most are: a file
    written within the last 2 s is read at start only once it has held still that long
    (gateway.config_file.read_config_settled; tests/test_serve.py starts one from a file still being written)."""
    path.write_text(text)
    earlier = time.time() - 60
    os.utime(path, (earlier, earlier))
