"""Validating the constraints too big for the event loop, in worker processes, within a deadline.

A worker is a child process (``python -m gateway.structured.worker``: a fresh interpreter that inherits none
of the server's threads nor re-runs its main script) started on first use; it runs one check at a time and
talks JSON lines over its standard input and output, so the event loop only writes and reads a pipe and
never shares the GIL with validation. A check still running at the deadline is the client's 400 (a
constraint too complex to validate in ``limits.validation_timeout`` seconds), and its worker is killed (a
thread could not be) and replaced. Waiting for a free worker has its own, longer bound
(``limits.validation_queue_timeout``: a burst of large constraints on a one-worker machine queues, and each
still gets its verdict); a request that waited all of it gets a 503 to retry. The workers are shared fairly
between API keys (:class:`~gateway.structured.fair_slots.FairSlots`): a key's waiting constraints take turns
with every other key's, and a key with ``PER_KEY_WAITING`` waiting has the next refused at once.
Verdicts are memoised by content and key: a client sending the same large schema with every request pays once
(and no key learns from a fast verdict what another key sent).

The workers also check finished answers against their constraints (:meth:`ValidationWorkers.check_answer`,
``structured_output.validate_outputs``), in the same fair turns. That check is a safety net, never the
answer's failure: an answer whose check finds no free worker within ``limits.output_check_timeout``, or runs
past it, or is larger than ``MAX_CHECKED_BYTES``, reaches the client unchecked, and says why.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson

import gateway
from gateway.config import LimitSettings
from gateway.structured.bounds import Bounds, ConstraintInvalid
from gateway.structured.check import INLINE, answer_verdict, strict_calls
from gateway.structured.checks import Verdict
from gateway.structured.constraint import Constraint
from gateway.structured.fair_slots import FairSlots, OwnerQueueFull

START_TIMEOUT = 60.0  # seconds a new worker gets to start (importing jsonschema on a busy machine)
MEMO_CHARS = 16 * 1024 * 1024  # remembered verdicts, measured in the characters of their renderings
_LINE_LIMIT = 64 * 1024 * 1024  # a verdict's renderings may be several times the 128 KiB grammar
_GATEWAY_ROOT = str(Path(gateway.__file__).resolve().parent.parent)  # workers import the gateway this one runs
PER_KEY_WAITING = 16  # constraints one API key may have waiting for a worker
MAX_CHECKED_BYTES = 1 << 20  # answers checked (each choice's text is checked to check.MAX_ANSWER_BYTES)
KILL_MARGIN = 1.0  # seconds past an answer check's own deadline (a timer in the worker) before it is killed


class ValidationBusy(Exception):
    """No worker could take the check in time (or one died): the gateway's fault, not the client's."""


def _payload(constraint: Constraint) -> tuple[str, str]:
    if constraint.kind == "json_schema":
        return "json_schema", orjson.dumps(constraint.schema).decode()
    if constraint.kind == "regex":
        return "regex", constraint.pattern
    if constraint.kind == "structural_tag":
        return "structural_tag", orjson.dumps(constraint.tag).decode()
    return "grammar", constraint.grammar


def _chars(verdict: Verdict) -> int:
    return sum(len(text) for _, text in verdict.renderings)


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        assert process.stdin is not None and process.stdout is not None
        self.stdin = process.stdin
        self.stdout = process.stdout

    @classmethod
    async def start(cls) -> _Worker:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_GATEWAY_ROOT, env.get("PYTHONPATH")) if p)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.structured.worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env, limit=_LINE_LIMIT)
        worker = cls(process)
        try:
            ready = await asyncio.wait_for(worker.stdout.readline(), START_TIMEOUT)
        except BaseException:
            worker.kill()
            raise
        if ready.strip() != b'"ready"':
            worker.kill()
            raise ValidationBusy("a constraint-validation worker did not start; retry shortly")
        return worker

    async def ask(self, job: list[Any]) -> Any:
        self.stdin.write(orjson.dumps(job) + b"\n")
        await self.stdin.drain()
        line = await self.stdout.readline()
        if not line:
            raise ConnectionError("the worker exited")
        return orjson.loads(line)

    async def check(self, job: list[Any]) -> Verdict:
        renderings, problem, code, fanout = await self.ask(job)
        return Verdict(tuple((dialect, text) for dialect, text in renderings), problem, code, fanout)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    def cpu_seconds(self) -> float | None:
        """The CPU time the worker has used (Linux's /proc), or None where that cannot be read."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as stat:
                fields = stat.read().rpartition(b")")[2].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # (utime, stime)
        except (OSError, ValueError, IndexError):
            return None


# the share of the validation deadline a worker must have spent on the CPU for a check past it to be the
# constraint's fault (a quarter: a worker at work on a 2-core machine gets half a core at least)
IDLE_SHARE = 0.25
# what talking to a worker that died raises: its pipe closed (asyncio: ConnectionResetError, BrokenPipeError;
# uvloop, which the server runs: RuntimeError "the handler is closed"), or a line cut short (ValueError)
_DEAD = (OSError, RuntimeError, ValueError)


class ValidationWorkers:
    """The worker processes of one gateway; ``close`` when it stops."""

    def __init__(self, limits: LimitSettings, workers: int | None = None) -> None:
        self._bounds = Bounds.of(limits)
        self._timeout = limits.validation_timeout
        self._queue_timeout = limits.validation_queue_timeout
        self._check_timeout = limits.output_check_timeout
        self._count = workers or max(1, min(4, (os.cpu_count() or 2) // 2))
        self._workers: list[_Worker | None] = [None] * self._count
        self._slots = FairSlots(self._count, PER_KEY_WAITING)
        self._verdicts: OrderedDict[bytes, Verdict] = OrderedDict()
        self._finishing: set[asyncio.Task[None]] = set()  # answer checks whose client left, running out
        # a killed worker's replacement, started at once (not in the next job's turn): slot -> its start
        self._starting: dict[int, asyncio.Task[_Worker]] = {}
        self._dying: set[asyncio.Future[int]] = set()  # killed workers being reaped
        self._memo_chars = 0

    def set_limits(self, limits: LimitSettings) -> None:
        """Take reloaded limits (validations already running keep theirs)."""
        self._bounds = Bounds.of(limits)
        self._timeout = limits.validation_timeout
        self._queue_timeout = limits.validation_queue_timeout
        self._check_timeout = limits.output_check_timeout

    async def validate(self, constraint: Constraint, owner: str) -> Constraint:
        """``constraint`` validated (``pending`` cleared, renderings found) in ``owner``'s (its API key's) turn;
        ConstraintInvalid when it is not valid or took longer than the deadline, ValidationBusy when no worker
        was free in time or the owner has too many waiting."""
        param = constraint.pending
        if param is None:
            return constraint
        kind, payload = _payload(constraint)
        verdict = await self._verdict(kind, payload, constraint.dialect, param, owner)
        return replace(constraint, renderings=verdict.renderings, pending=None, fanout=verdict.fanout)

    async def validate_tools(self, tools: Any, owner: str) -> str | None:
        """A request's tools bounded (their parameter schemas, as :func:`~gateway.structured.constraint.tools_fanout`
        bounds them) in ``owner``'s turn: why llama.cpp should not take them, or None; ConstraintInvalid or
        ValidationBusy as :meth:`validate`."""
        return (await self._verdict("tools", orjson.dumps(tools).decode(), "gbnf", "tools", owner)).fanout

    async def _verdict(self, kind: str, payload: str, dialect: str, param: str, owner: str) -> Verdict:
        key = hashlib.blake2b(repr((owner, kind, dialect, param, self._bounds)).encode(), digest_size=16)
        key.update(payload.encode("utf-8", "surrogatepass"))
        digest = key.digest()
        verdict = self._verdicts.get(digest)
        if verdict is None:
            bounds = self._bounds
            job = [kind, payload, dialect, param, [bounds.max_nesting, bounds.max_bytes, bounds.max_rules]]
            verdict = await self._run(job, param, owner)
            self._remember(digest, verdict)
        else:
            self._verdicts.move_to_end(digest)
        if verdict.problem is not None:
            raise ConstraintInvalid(verdict.problem, param, verdict.code)
        return verdict

    async def _turn(self, owner: str, patience: float) -> tuple[int, _Worker]:
        """A worker slot in ``owner``'s turn and its (started) worker; release the slot when done. Raises
        ValidationBusy when none came within ``patience`` seconds, the owner has too many waiting, or the
        worker would not start."""
        try:
            slot = await self._slots.acquire(owner, patience)
        except OwnerQueueFull:
            raise ValidationBusy(f"this API key has {PER_KEY_WAITING} checks waiting for a validation worker "
                                 "already; retry when they are done") from None
        except TimeoutError:
            raise ValidationBusy(f"every constraint-validation worker stayed busy for {patience:g} s; "
                                 "retry shortly") from None
        try:
            worker = self._workers[slot]
            if worker is not None and worker.process.returncode is not None:
                # (it died while idle: killed, a hang-up of the process group, the OOM killer; sweep 24 found it
                # kept for good, and every later check of every key failing)
                self._workers[slot] = worker = None
            if worker is None:  # its start is no part of any client's deadline
                starting = self._starting.pop(slot, None)
                try:
                    worker = self._workers[slot] = await (starting if starting is not None else _Worker.start())
                except (OSError, TimeoutError, ValidationBusy) as exc:
                    raise ValidationBusy(f"a constraint-validation worker did not start ({exc!r}); "
                                         "retry shortly") from None
        except BaseException:
            self._slots.release(slot)
            raise
        return slot, worker

    async def _run(self, job: list[Any], param: str, owner: str) -> Verdict:
        slot, worker = await self._turn(owner, self._queue_timeout)
        try:
            used = worker.cpu_seconds()
            try:
                return await asyncio.wait_for(worker.check(job), self._timeout)
            except TimeoutError:
                spent = worker.cpu_seconds()
                self._kill(slot)
                if (used is not None and spent is not None and self._timeout >= 0.5  # (CPU time comes in 10 ms ticks)
                        and spent - used < IDLE_SHARE * self._timeout):
                    # (it hardly ran: stopped, or starved of CPU; the constraint's fault it is not: a SIGSTOPped
                    # idle worker made the next client's valid schema a 400, sweep 24)
                    raise ValidationBusy("a constraint-validation worker did not work on it in time (stopped, or "
                                         "the machine is overloaded); retry shortly") from None
                raise ConstraintInvalid(f"{param}: too complex to validate within {self._timeout:g} s "
                                        "(limits.validation_timeout)", param, "constraint_too_complex") from None
            except _DEAD:
                self._kill(slot)
                raise ValidationBusy("a constraint-validation worker died; retry shortly") from None
            except asyncio.CancelledError:  # the client left: stop the work it started
                self._kill(slot)
                raise
        finally:
            self._slots.release(slot)

    async def check_answer(self, route: str, raw: bytes, constraint: Constraint, owner: str
                           ) -> tuple[str | None, str | None]:
        """Why the finished answer ``raw`` does not satisfy ``constraint`` (None when it does), and why it was not
        checked (None when it was). Kinds in ``check.INLINE`` are checked here, the rest by a worker in
        ``owner``'s turn within ``limits.output_check_timeout``: waiting included, as the answer waits too."""
        if constraint.kind in INLINE:
            return answer_verdict(route, raw, constraint)
        if constraint.kind == "strict_tools" and (route != "chat" or not strict_calls(raw, constraint)):
            return None, None  # (no call of a strict tool: nothing to check)
        if len(raw) > MAX_CHECKED_BYTES:
            return None, f"the answer is larger than {MAX_CHECKED_BYTES} bytes"
        spec = constraint.pattern if constraint.kind == "regex" else constraint.schema
        timeout = self._check_timeout
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            slot, worker = await self._turn(owner, timeout)
        except ValidationBusy as exc:
            return None, str(exc)
        handed_on = False
        try:
            left = max(0.001, timeout - (loop.time() - start))
            job = ["answer", route, constraint.kind, spec, raw.decode("utf-8", "replace"), left]
            asked = asyncio.ensure_future(worker.ask(job))
            try:
                problem, unchecked = await asyncio.wait_for(asyncio.shield(asked), left + KILL_MARGIN)
            except TimeoutError:
                asked.cancel()
                self._kill(slot)
                return None, "the check ran past its deadline (limits.output_check_timeout)"
            except _DEAD:
                self._kill(slot)
                return None, "the validation worker died"
            except asyncio.CancelledError:  # the client left: the check ends by its own deadline, and killing
                # the worker would cost every key's next check its restart
                handed_on = True
                self._finishing.add(asyncio.create_task(self._finish(slot, asked, left + KILL_MARGIN)))
                raise
            return problem, unchecked
        finally:
            if not handed_on:
                self._slots.release(slot)

    async def _finish(self, slot: int, asked: asyncio.Future[Any], within: float) -> None:
        """Wait out a check whose client left, then free its slot (killing its worker if it overruns)."""
        try:
            await asyncio.wait_for(asked, within)
        except BaseException:  # (overran, died, or the gateway stops)
            self._kill(slot)
        finally:
            self._slots.release(slot)
            task = asyncio.current_task()
            if task is not None:
                self._finishing.discard(task)

    def _kill(self, slot: int) -> None:
        worker, self._workers[slot] = self._workers[slot], None
        if worker is not None:
            worker.kill()
            # (reaped, and its pipes closed, while the loop runs: left to the collector they complained of a
            # closed loop in whatever ran next)
            dying = asyncio.ensure_future(worker.process.wait())
            self._dying.add(dying)
            dying.add_done_callback(self._dying.discard)
            if slot not in self._starting:  # (its replacement starts now, while the slot's holder finishes)
                self._starting[slot] = asyncio.ensure_future(_Worker.start())

    def _remember(self, digest: bytes, verdict: Verdict) -> None:
        self._verdicts[digest] = verdict
        self._memo_chars += _chars(verdict)
        while self._memo_chars > MEMO_CHARS or len(self._verdicts) > 1024:
            _, old = self._verdicts.popitem(last=False)
            self._memo_chars -= _chars(old)

    async def close(self) -> None:
        """Stop every worker (and wait for them to go)."""
        for task in list(self._finishing):
            task.cancel()
        await asyncio.gather(*self._dying, return_exceptions=True)
        # (a replacement starting is let finish, then stopped: cancelled mid-start, its process was left unreaped)
        started = await asyncio.gather(*self._starting.values(), return_exceptions=True)
        self._starting.clear()
        for worker in started:
            if isinstance(worker, _Worker):
                worker.kill()
                await worker.process.wait()
        workers = [w for w in self._workers if w is not None]
        self._workers = [None] * self._count
        for worker in workers:
            worker.kill()
        for worker in workers:
            await worker.process.wait()
