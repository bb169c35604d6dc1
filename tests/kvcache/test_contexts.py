"""ZeroMQ contexts the collector cannot hang on (gateway.kvcache.contexts), in a child process with a deadline:
a context collected in a cycle with its open socket hangs the collecting thread for good."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.system

CYCLE = """
import gc, weakref, zmq
from gateway.kvcache.contexts import close_context, held, open_context

class Holder:
    pass

def garbage():
    h = Holder()
    h.ctx = {open}
    h.sock, h.me = h.ctx.socket(zmq.SUB), h
    h.sock.connect("tcp://127.0.0.1:9")  # connecting for ever: nothing closes it but its owner or finalizer
    return weakref.ref(h.ctx), weakref.ref(h.sock)

ctx, sock = garbage()
print("collecting", flush=True)
gc.collect()
print("collected", flush=True)
{close}
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_a_plain_context_collected_with_its_open_socket_hangs_the_collector() -> None:
    """The hazard itself (so the test below proves something): pyzmq's finalizer calls term() on a context
    whose socket is still open."""
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        subprocess.run([sys.executable, "-c", CYCLE.format(open="zmq.Context()", close="")],
                       capture_output=True, timeout=5)
    out = hung.value.stdout or b""
    assert out.split() == [b"collecting"], out


def test_a_held_context_is_never_garbage_and_its_forgotten_socket_is_collected_alone() -> None:
    done = run(CYCLE.format(open="open_context(zmq.Context)",
                            close="assert sock() is None and held() == 1\nclose_context(ctx())\nassert held() == 0\n"
                                  "print('closed', flush=True)"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["collecting", "collected", "closed"]


def test_close_context_closes_the_sockets_left_open() -> None:
    done = run("""
        import zmq, zmq.asyncio
        from gateway.kvcache.contexts import close_context, held, open_context
        ctx = open_context(zmq.asyncio.Context)
        sock = ctx.socket(zmq.DEALER)
        sock.connect("tcp://127.0.0.1:9")
        assert ctx.getsockopt(zmq.LINGER) == 0 and held() == 1
        close_context(ctx)
        assert sock.closed and ctx.closed and held() == 0
    """)
    assert done.returncode == 0, done.stderr
