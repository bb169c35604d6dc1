"""Build only the ``llama-server`` target (CPU, release) from the llama.cpp copy vendored in a pinned
llama-cpp-python sdist, and cache the binary outside the repository.

    gateway llamacpp build [--jobs N] [--force]     prints the binary's path

The build takes about 10 minutes on 2 cores, once: the binary is cached under
``$XDG_CACHE_HOME/llm-gateway`` (default ``~/.cache/llm-gateway``) keyed by the sdist version and this
machine's CPU features (the build targets the host CPU), and reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

SDIST_PACKAGE = "llama-cpp-python"
SDIST_VERSION = "0.3.36"

# CPU only, release, nothing that downloads at build time (the prebuilt web UI) or needs extra libraries.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_METAL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
)


class BuildError(RuntimeError):
    """The build cannot run or failed; the message says what to do."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-gateway"


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold the cache's lock ``name`` (an advisory ``flock``, let go when the process ends however it ends):
    processes that need the same cached file at once (the test suite's workers) make it once, the others wait
    for it instead of building it beside."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def staging_path(target: Path) -> Path:
    """A path beside ``target`` no other process writes to, to write it aside and then move it into place."""
    return target.with_name(f".{target.name}.{os.getpid()}.tmp")


def _cpu_key() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def binary_path() -> Path:
    return cache_dir() / f"llama-server-{SDIST_VERSION}-{platform.machine()}-{_cpu_key()}"


def _works(binary: Path) -> bool:
    try:
        result = subprocess.run([str(binary), "--version"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def check_toolchain() -> None:
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        missing.append("a C compiler (gcc or clang)")
    if not any(shutil.which(m) for m in ("ninja", "make")):
        missing.append("make or ninja")
    if missing:
        raise BuildError(
            "cannot build llama-server: missing " + ", ".join(missing)
            + ". On Debian/Ubuntu: apt-get install cmake build-essential"
        )


def _run(cmd: list[str], cwd: Path, log: Path) -> None:
    with log.open("ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        result = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise BuildError(f"{cmd[0]} failed (exit {result.returncode}); last lines of {log}:\n" + "\n".join(tail))


def build(jobs: int | None = None, force: bool = False, quiet: bool = False) -> Path:
    """Return the path of a working cached ``llama-server``, building it first if needed."""
    target = binary_path()
    if not force and target.exists() and _works(target):
        return target
    with cache_lock(target.name):
        if not force and target.exists() and _works(target):
            return target  # another process built it while this one waited
        return _build(target, jobs, quiet)


def _build(target: Path, jobs: int | None, quiet: bool) -> Path:
    check_toolchain()
    target.parent.mkdir(parents=True, exist_ok=True)
    jobs = jobs or os.cpu_count() or 2
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp_name:
        tmp = Path(tmp_name)
        log = target.parent / f"build-{SDIST_VERSION}.log"
        log.write_text("")

        def say(msg: str) -> None:
            if not quiet:
                print(f"[llama-server build] {msg}", file=sys.stderr, flush=True)

        say(f"downloading the {SDIST_PACKAGE}=={SDIST_VERSION} sdist")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"{SDIST_PACKAGE}=={SDIST_VERSION}", "-d", str(tmp)], tmp, log)
        sdists = list(tmp.glob("*.tar.gz"))
        if not sdists:
            raise BuildError(f"pip download produced no sdist in {tmp}; see {log}")
        say("extracting vendor/llama.cpp")
        prefix = f"{sdists[0].name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            archive.extractall(tmp, members=members, filter="data")
        source = tmp / prefix
        say(f"configuring and building llama-server with {jobs} jobs (about 10 minutes on 2 cores); log: {log}")
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run(["cmake", "-S", str(source), "-B", str(source / "build"), *generator, *CMAKE_FLAGS], source, log)
        _run(["cmake", "--build", str(source / "build"), "--target", "llama-server", "-j", str(jobs)], source, log)
        built = source / "build" / "bin" / "llama-server"
        if not built.exists():
            raise BuildError(f"the build finished but {built} is missing; see {log}")
        staging = staging_path(target)
        shutil.copy2(built, staging)
        staging.replace(target)
    if not _works(target):
        raise BuildError(f"{target} was built but does not run (--version failed)")
    say(f"cached {target}")
    return target
