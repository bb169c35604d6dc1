"""What the worker processes of one gateway (``server.workers``) say to each other.

Each worker listens on a UNIX socket of its own, in a directory that the supervisor made and only its user
can enter, and answers one question per connection:

* ``metrics``: its own registry's exposition. The worker that Prometheus's scrape reached asks every other
  worker and answers with the sum (:mod:`gateway.telemetry.merge`), so one scrape sees the whole gateway.
* ``pool``: its pool's last readings of every backend. Only the first worker scrapes the engines; the others
  take its readings every scrape interval (and scrape for themselves while it has none to give), so a pod
  scrapes each engine once, whatever its number of workers.

And each worker tells its supervisor what it applied (:class:`InForce`: after a reload, or a change through the
admin API), over a pipe of its own: a worker the supervisor starts again runs that, never the configuration the
gateway started with (a key revoked by a reload worked again on a restarted worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from prometheus_client import CollectorRegistry, generate_latest

from gateway.config import ApiKeySettings, Settings
from gateway.pool.pool import Pool
from gateway.telemetry.merge import merge_expositions

log = logging.getLogger("gateway.workers")

_QUESTIONS = (b"metrics", b"pool", b"recent")
_MAX_ANSWER = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class InForce:
    """The configuration a worker runs: its effective settings, and the file's bytes they were read from (what
    its file watch compares the file with; None: read the file when the watch starts); and every API key in force
    since the start, oldest first, with the settings it last had (a reload that brings a removed key back holds it
    to them: a worker started again knew none, and took such a key back without its limits: sweep 20)."""

    settings: Settings
    content: bytes | None
    known: tuple[ApiKeySettings, ...] = ()
    # a reload the other workers must make too, whatever the file holds (the admin API's: it also undoes the
    # admin API's changes since, which reached the others over Redis alone; sweep 22)
    tell: bool = False


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    index: int  # 0 is the first worker: the one that scrapes the engines
    count: int
    run_dir: str  # the supervisor's directory (mode 0700) holding every worker's socket
    # what every worker seals its messages to the others with (gateway.state.sealing), derived once by the
    # supervisor from the configuration it started with: derived by each worker from its own, a worker started
    # again after a reload that changed the keys sealed with another secret, and it and the others dropped each
    # other's messages (None: none derived; the state section alone, which no reload changes, gives the same)
    seal_secret: bytes | None = field(default=None, repr=False)

    def socket_path(self, index: int) -> str:
        return str(Path(self.run_dir) / f"worker-{index}.sock")


class Siblings:
    """One worker's end of the channel: its own socket server, and the questions it asks the others."""

    def __init__(self, me: WorkerIdentity, registry: CollectorRegistry, pool: Pool, *,
                 timeout: float = 2.0) -> None:
        self.me = me
        self._registry = registry
        self._pool = pool
        self._timeout = timeout
        self._server: asyncio.AbstractServer | None = None
        self._answers: dict[bytes, Callable[[], bytes]] = {
            b"metrics": lambda: generate_latest(self._registry),
            b"pool": lambda: orjson.dumps(self._pool.snapshot()),
        }

    def answer(self, question: bytes, answer: Callable[[], bytes]) -> None:
        """What this worker answers ``question`` with (another component's view)."""
        assert question in _QUESTIONS
        self._answers[question] = answer

    async def start(self) -> None:
        path = self.me.socket_path(self.me.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by this worker's previous life
        self._server = await asyncio.start_unix_server(self._serve, path=path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.me.socket_path(self.me.index))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            question = (await asyncio.wait_for(reader.readline(), self._timeout)).strip()
            answer = self._answers.get(question)
            if answer is not None:
                writer.write(answer())
                await asyncio.wait_for(writer.drain(), self._timeout)
        except (OSError, TimeoutError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def ask(self, index: int, question: bytes) -> bytes | None:
        """Worker ``index``'s answer, or None when it gives none in time (restarting, gone, stuck)."""
        assert question in _QUESTIONS
        try:
            async with asyncio.timeout(self._timeout):
                reader, writer = await asyncio.open_unix_connection(self.me.socket_path(index))
                try:
                    writer.write(question + b"\n")
                    answer = bytearray()
                    while chunk := await reader.read(1 << 16):
                        answer += chunk
                        if len(answer) > _MAX_ANSWER:
                            return None
                    return bytes(answer)
                finally:
                    writer.close()
        except (OSError, TimeoutError):
            return None

    async def ask_others(self, question: bytes) -> list[bytes | None]:
        """Every other worker's answer (None where one gives none in time)."""
        others = [i for i in range(self.me.count) if i != self.me.index]
        return list(await asyncio.gather(*(self.ask(i, question) for i in others)))

    async def leader_snapshot(self) -> bytes | None:
        return await self.ask(0, b"pool")

    async def metrics(self) -> bytes:
        """The whole gateway's exposition: this worker's and every other's that answers in time, added up."""
        others = [i for i in range(self.me.count) if i != self.me.index]
        answers = await asyncio.gather(*(self.ask(i, b"metrics") for i in others))
        texts = [generate_latest(self._registry).decode()]
        texts += [a.decode() for a in answers if a is not None]
        missing = [i for i, a in zip(others, answers, strict=True) if a is None]
        if missing:
            log.warning("/metrics: workers %s did not answer; their figures are missing from this scrape", missing)
        # parsing a few hundred kilobytes of text takes milliseconds: off the event loop
        return await asyncio.to_thread(merge_expositions, texts, workers=len(texts))
