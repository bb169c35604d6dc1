"""The engines' released Python sources, fetched from PyPI once and cached outside the repository.

Nothing of the engines' code is committed: each pinned release is downloaded through PyPI's simple index (the
JSON form pip itself reads, PEP 691), checked against the sha256 the index publishes, and only its ``.py``
files are unpacked into ``$XDG_CACHE_HOME/llm-gateway/released/<package>-<version>/`` (next to the cached
llama-server). Nothing is built and nothing is installed: vLLM's metadata build needs torch, and neither
engine's code is imported as an installed package (see ``tests/released/loader.py``).

Unpacking goes to a temporary directory renamed into place, so two pytest processes fetching at once both end
with one complete copy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.llamacpp.build import SDIST_VERSION, cache_dir

SIMPLE_INDEX = "https://pypi.org/simple"
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Release:
    package: str  # the distribution's name on PyPI
    version: str
    kind: str  # "sdist" or "wheel": which file of the release holds the Python sources
    top: str  # the import package inside it ("vllm", "sglang"), or the folder wanted from it
    suffix: str = ".py"  # the files unpacked from ``top``

    @property
    def label(self) -> str:
        return f"{self.package}-{self.version}"


# the newest and the oldest release of each engine the gateway claims to speak to
SGLANG_NEWEST = Release("sglang", "0.5.23", "wheel", "sglang")
SGLANG_OLDEST = Release("sglang", "0.5.19", "wheel", "sglang")
VLLM_NEWEST = Release("vllm", "0.34.0", "sdist", "vllm")
VLLM_OLDEST = Release("vllm", "0.23.0", "sdist", "vllm")
# llama.cpp's example grammars, from the sdist llama-server is built from
LLAMA_CPP_GRAMMARS = Release("llama-cpp-python", SDIST_VERSION, "sdist", "vendor/llama.cpp/grammars", ".gbnf")


class Unreachable(RuntimeError):
    """PyPI could not be reached at all (no network): the only failure that may skip the tests."""


def source_root(release: Release) -> Path:
    """Where the release's import package is unpacked: ``<root>/<top>/...``."""
    return cache_dir() / "released" / release.label


def ensure(release: Release) -> Path:
    """The unpacked sources of ``release``, fetched first if the cache lacks them.

    Raises :class:`Unreachable` when they are not cached and PyPI cannot be reached; any other failure
    (the release or its file missing, a hash that does not match) is an error."""
    root = source_root(release)
    if (root / ".complete").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{release.label}-", dir=root.parent) as tmp_name:
        tmp = Path(tmp_name)
        archive = _download(release, tmp)
        unpacked = tmp / "unpacked"
        _unpack_python(archive, release, unpacked)
        (unpacked / ".complete").write_text(archive.name + "\n")
        try:
            unpacked.rename(root)
        except OSError:  # another process got there first; its copy is as good as ours
            if not (root / ".complete").exists():
                raise
    return root


def _open(url: str, accept: str | None = None) -> Any:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        return urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError:  # PyPI answered: not a missing network
        raise
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise Unreachable(f"{url}: {exc}") from exc


def _download(release: Release, into: Path) -> Path:
    url = f"{SIMPLE_INDEX}/{release.package}/"
    with _open(url, "application/vnd.pypi.simple.v1+json") as answer:
        index = json.load(answer)
    name, file_url, sha256 = _pick(index, release)
    target = into / name
    digest = hashlib.sha256()
    with _open(file_url) as answer, target.open("wb") as out:
        while chunk := answer.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"{name}: sha256 {digest.hexdigest()} is not the index's {sha256}")
    return target


def _pick(index: dict[str, Any], release: Release) -> tuple[str, str, str]:
    """(file name, URL, sha256) of the release's sdist, or of one of its wheels (the same Python sources in
    each; the pure-Python one if there is one, else the smallest, for a deterministic pick)."""
    files = [f for f in index.get("files", []) if isinstance(f, dict)]
    if release.kind == "sdist":
        stems = (release.label, f"{release.package.replace('-', '_')}-{release.version}")  # (PEP 625's name)
        names = {f"{stem}{ext}" for stem in stems for ext in (".tar.gz", ".zip")}
        wanted = [f for f in files if f["filename"] in names]
    else:
        stem = f"{release.package.replace('-', '_')}-{release.version}-"
        wanted = sorted((f for f in files if f["filename"].startswith(stem) and f["filename"].endswith(".whl")),
                        key=lambda f: ("-none-any." not in f["filename"], f.get("size") or 0, f["filename"]))
    wanted = [f for f in wanted if not f.get("yanked") and f.get("hashes", {}).get("sha256")]
    if not wanted:
        raise RuntimeError(f"PyPI lists no {release.kind} of {release.package} {release.version}")
    chosen = wanted[0]
    return chosen["filename"], chosen["url"], chosen["hashes"]["sha256"]


def _unpack_python(archive: Path, release: Release, into: Path) -> None:
    """Only the import package's ``.py`` files (``release.suffix``), as ``into/<top>/...``; nothing is executed."""
    into.mkdir()
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as wheel:
            for name in wheel.namelist():
                if name.startswith(f"{release.top}/") and name.endswith(release.suffix) and ".." not in name:
                    target = into / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with wheel.open(name) as src, target.open("wb") as dst:
                        shutil.copyfileobj(src, dst)
        return
    stem = archive.name.removesuffix(".tar.gz")
    prefix = f"{stem}/{release.top}/"
    with tarfile.open(archive) as sdist:
        for member in sdist:
            if member.isfile() and member.name.startswith(prefix) and member.name.endswith(release.suffix):
                member.name = member.name.removeprefix(f"{stem}/")
                sdist.extract(member, into, filter="data")
