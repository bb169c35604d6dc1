"""The access-log writer: whole lines, in order, in batches from a thread of its own; a blocked stream never
blocks the caller (the event loop); everything is written by ``stop``. And the access logger's fast path."""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Iterator

import pytest

from gateway.proxy import accounting
from gateway.proxy.accounting import AccessLogHandler, AccessLogWriter
from tests.waiting import wait_until


class Stream(io.StringIO):
    """Records each write call; ``gate`` (when given) holds every write until it is set; ``entered`` is set once
    a write has begun."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.gate = gate
        self.entered = threading.Event()

    def write(self, s: str) -> int:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        self.calls.append(s)
        return super().write(s)


def test_lines_are_whole_in_order_batched_and_all_written_on_stop() -> None:
    stream = Stream()
    writer = AccessLogWriter(stream, interval=0.01, batch=64)
    writer.start()
    for i in range(1000):
        writer.write(b'{"n":%d}' % i)
        if i % 100 == 0:  # the thread writes while lines keep coming
            wait_until(lambda: stream.getvalue().count("\n") == i + 1, f"the thread wrote line {i}")  # noqa: B023
    writer.stop()
    assert stream.getvalue() == "".join(f'{{"n":{i}}}\n' for i in range(1000))
    assert all(call.endswith("\n") for call in stream.calls)  # a call never ends mid-line
    assert len(stream.calls) < 200  # many lines a call
    writer.write(b"after")  # once stopped, straight to the stream
    assert stream.getvalue().endswith('{"n":999}\nafter\n')


def test_a_full_batch_is_written_without_waiting_for_the_interval() -> None:
    stream = Stream()
    writer = AccessLogWriter(stream, interval=30.0, batch=4)
    writer.start()
    try:
        for i in range(4):
            writer.write(b"%d" % i)
        # (bounded well within the 30 s interval)
        wait_until(lambda: stream.getvalue() == "0\n1\n2\n3\n", "the full batch written", within=10)
    finally:
        writer.stop()


def test_a_blocked_stream_does_not_block_the_caller_and_loses_nothing() -> None:
    gate = threading.Event()
    stream = Stream(gate)
    writer = AccessLogWriter(stream, interval=0.001, batch=8)
    writer.start()
    writer.write(b"first")
    assert stream.entered.wait(timeout=10), "the thread never wrote"  # it is now stuck in write()
    for i in range(20000):  # each returns while the stream is held (a write that waited on it would never end)
        writer.write(b"%d" % i)
    assert stream.getvalue() == ""
    gate.set()
    writer.stop()
    assert stream.getvalue().splitlines() == ["first", *(str(i) for i in range(20000))]


@pytest.fixture
def access_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("gateway.access")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


def test_accounting_writes_directly_only_when_the_writer_is_the_access_loggers_only_handler(
        access_logger: logging.Logger) -> None:
    stream = Stream()
    writer = AccessLogWriter(stream)
    access_logger.handlers[:] = [AccessLogHandler(writer)]
    access_logger.setLevel(logging.INFO)
    access_logger.propagate = False
    assert accounting._direct_writer() == writer.write  # how `gateway serve` sets it up

    access_logger.setLevel(logging.WARNING)  # silenced: no line
    assert accounting._direct_writer() is None
    access_logger.setLevel(logging.INFO)
    access_logger.propagate = True  # someone listens further up
    assert accounting._direct_writer() is None
    access_logger.propagate = False
    seen: list[str] = []

    class Mine(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    access_logger.addHandler(Mine())  # an embedder's handler: records go through logging, to both
    assert accounting._direct_writer() is None
    access_logger.info('{"a":1}')
    writer.stop()
    assert seen == ['{"a":1}'] and stream.getvalue() == '{"a":1}\n'
