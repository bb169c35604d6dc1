"""What a streamed answer costs on the client's connection, write by write: the gateway's server protocol is
wrapped so that every write to the client's transport is recorded as it goes."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over
from tests.waiting import until

REQUEST = (b'POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d'
           b'\r\n\r\n%s')
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'


class _Recorded:
    """A transport that records what is written through it, and is the transport for everything else."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def _record(server: Any, client_port: int) -> _Recorded:
    """Wrap the transport of the server's connection from ``client_port`` (once the server has accepted it)."""

    def accepted() -> Any:
        return next((protocol for protocol in server.server_state.connections if protocol.transport is not None
                     and protocol.transport.get_extra_info("peername")[1] == client_port), None)

    await until(accepted, "the server accepted the connection")
    protocol = accepted()
    recorded = _Recorded(protocol.transport)
    protocol.transport = recorded
    return recorded


@contextlib.contextmanager
def _wired(upstream: ScriptedUpstream) -> Iterator[tuple[socket.socket, _Recorded]]:
    """A gateway in front of ``upstream``, a client connection to it, and that connection's recorded writes."""
    _app, server = gateway_over(upstream)
    with server as gw, socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        yield sock, gw.call(_record(gw.server, sock.getsockname()[1]))


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        piece = sock.recv(65536)
        assert piece, f"the connection closed early: {data!r}"
        data += piece
    return data


def test_a_streams_head_goes_out_with_its_first_event_in_one_write() -> None:
    with ScriptedUpstream(tokens=3, every=0.05) as upstream, _wired(upstream) as (sock, recorded):
        sock.sendall(REQUEST % (len(BODY), BODY))
        answer = _read_response(sock)
    assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
    first = recorded.writes[0]
    assert first.startswith(b"HTTP/1.1 200") and b"text/event-stream" in first, first
    # the head and the first event: one write, one system call, and the client reads them together
    assert b'"content":"t0 "' in first and first.endswith(b"}\n\n\r\n"), first
    assert b"".join(recorded.writes) == answer
    # then one write per event as it came (the tokens are 50 ms apart), and the end
    assert sum(b'"content":"t' in w for w in recorded.writes) == 3


def _read_sized(sock: socket.socket) -> bytes:
    """One response with a content-length, whole."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
            data.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
        piece = sock.recv(65536)
        assert piece, f"the connection closed early: {data!r}"
        data += piece
    return data


def test_a_whole_answer_in_one_upstream_read_goes_out_in_one_write() -> None:
    """The whole stream came before the response started (a short answer, a busy gateway): its head, its events
    and the chunked end in one write, where there were two."""
    with ScriptedUpstream("stream_at_once", tokens=3) as upstream, _wired(upstream) as (sock, recorded):
        sock.sendall(REQUEST % (len(BODY), BODY))
        answer = _read_response(sock)
    assert len(recorded.writes) == 1, recorded.writes
    assert recorded.writes[0] == answer
    assert answer.startswith(b"HTTP/1.1 200") and b"text/event-stream" in answer
    assert [t for t in (b"t0 ", b"t1 ", b"t2 ") if t in answer] == [b"t0 ", b"t1 ", b"t2 "]
    assert answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), answer
    assert b'"usage"' not in answer  # (the client did not ask for it)


def test_a_non_streamed_answer_and_an_error_each_go_out_in_one_write_on_a_kept_alive_connection() -> None:
    plain = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    unknown = b'{"model":"nope","messages":[{"role":"user","content":"hi"}]}'
    with ScriptedUpstream("complete", tokens=3) as upstream, _wired(upstream) as (sock, recorded):
        sock.sendall(REQUEST % (len(plain), plain))
        answer = _read_sized(sock)
        assert recorded.writes == [answer]
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"}") and b'"t0 t1 t2 "' in answer
        sock.sendall(REQUEST % (len(unknown), unknown))  # the same connection: kept alive after it
        error = _read_sized(sock)
    assert recorded.writes == [answer, error]
    assert error.startswith(b"HTTP/1.1 404") and b'"model_not_found"' in error, error


def test_a_whole_response_to_a_client_that_closes_is_written_before_the_connection_closes() -> None:
    """``Connection: close``: uvicorn closes the transport as it ends the response; what was framed goes first."""
    plain = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    closing = REQUEST.replace(b"Host: gw\r\n", b"Host: gw\r\nConnection: close\r\n")
    with ScriptedUpstream("complete", tokens=2) as upstream, _wired(upstream) as (sock, recorded):
        sock.sendall(closing % (len(plain), plain))
        answer = b""
        while piece := sock.recv(65536):
            answer += piece
    assert recorded.writes == [answer]
    assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer and b'"t0 t1 "' in answer
