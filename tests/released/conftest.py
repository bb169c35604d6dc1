"""The engines' released code, fetched once per machine (``tests/released/sources.py``) and loaded per release.

Run alone: ``pytest tests/released``. Without the network the tests skip, saying so, only when a release is
not cached yet; with it, a failed download, a missing release or a wrong hash fails them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.released.engines import RequestSide, SGLangRequests, VLLMRequests
from tests.released.sources import Release, Unreachable, ensure


def released(release: Release) -> Path:
    """The release's unpacked sources; skips (only) when they are not cached and PyPI cannot be reached."""
    try:
        return ensure(release)
    except Unreachable as exc:
        pytest.skip(f"{release.label} is not cached and PyPI is unreachable ({exc}); the released-code "
                    f"conformance tests need the network once")


@pytest.fixture(scope="session")
def request_side() -> Callable[[Release], RequestSide]:
    """The request models of a release, loaded once per session."""
    loaded: dict[Release, RequestSide] = {}

    def get(release: Release) -> RequestSide:
        if release not in loaded:
            root = released(release)
            loaded[release] = (SGLangRequests if release.package == "sglang" else VLLMRequests)(release, root)
        return loaded[release]

    return get
