"""The stall guard: a request with a grammar that slows the loop an engine runs every request on is stopped, and it
and its key's such requests are kept from such engines for a while.

llama.cpp follows a request's grammar (its constraint's, or the one it compiles from its tools) on the one loop that
samples every slot's token: a grammar whose parse goes many ways at once slows every other request on the server by
as much, token after token (sweeps 22-28: another key's answers from 0.09 s to 49 s). The static checks
(gateway.structured.syntax.parses, gateway.structured.checks) refuse or reroute the forms they know, and each sweep
found a form they did not. This guard needs no knowledge of forms. The pool measures the loop's step at every
scrape: a llama.cpp load reading is answered between two steps (``EngineSpec.load_waits_for_loop``), so it takes
what is left of the step under way, less the health check just before it, which the HTTP thread answers alone, and
less this process's own event-loop lag. When ``CONFIRM_READINGS`` of the last ``WINDOW`` readings take
``stall_seconds``, or ``stall_factor`` times the loop's usual, while requests with a grammar run there, the guard
stops one (the one running longest: a parse grows with its answer), answered 503 (or its stream ended with that
error), and holds its key's requests with a grammar until the verdict. Once the engine has surely let it go, a
prompt loop convicts it where nothing else could explain the recovery (no other request with a grammar ended in
the stall, and the engine runs nothing this process did not send it): its key's requests with a grammar (with no
keys, its grammar) are kept from such engines for ``strike_seconds``, doubled at each repeat up to a day: routed
to engines that follow grammars another way (vLLM, SGLang), or refused with a 429 that says until when. Where
something else could, the stall is unresolved and no one is struck (another key whose request ended meanwhile has
its requests stopped first at the next stall). If the loop is still slow, the next is stopped. A request that
ended lately without its answer (its client gone) may run on in the engine: a stall waits for the engine to let it
go before it stops anything, and a recovery then is that request's key's doing.

Kept per process: each replica (and each worker of one) finds and strikes for itself, and only where its readings
through the stall showed the engine running nothing another process sent it: where they share a llama-server
with others, each stops its own, and a key is struck once it stalls the engine where it is alone.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter

from gateway.clock import SYSTEM, Clock
from gateway.config import StallGuardSettings
from gateway.pool.backend import Backend
from gateway.pool.state import LoopReading
from gateway.routing.request import RouteRequest
from gateway.structured import CONSTRAINT_FIELDS

log = logging.getLogger(__name__)

CONFIRM_READINGS = 2  # slow readings among the last WINDOW before a request is stopped
WINDOW = 3
# readings after the engine surely let the stopped request go, all slow: it was not the cause
ACQUIT_READINGS = 2
ACQUIT_SECONDS = 40.0  # or this long after it ended here with no verdict
DROP_GRACE = 1.5  # the engine lets a request go within this (its look for a gone client) and DROP_STEPS steps
# (of the longest read since the stop, which is less than a step: one under way, one begun before its cancel is
# read, and margin; llama-server took 4.5 s to let go of a request at ~1 s steps)
DROP_STEPS = 4
MAX_STEP = 5.0  # (steps counted so at most)
# a key with a request stopped is held this long at most for its verdict (which comes within ACQUIT_SECONDS of its
# end, if readings come)
HOLD_SECONDS = ACQUIT_SECONDS + DROP_GRACE + DROP_STEPS * MAX_STEP
# a stall is a reading of stall_seconds, or of stall_factor times the loop's usual: the 90th percentile of its last
# USUAL_READINGS readings outside stalls (once it has USUAL_LEAST of them), from STALL_FLOOR seconds
USUAL_READINGS = 64
USUAL_LEAST = 16
STALL_FLOOR = 0.1
MAX_BACKENDS = 4096  # backends whose usual readings are kept
# a loop with no usual yet has its step alone measured (the pool sends its engine, idle, a few tokens of a plain
# request) at most this often: a gateway just started, or one whose requests always had a grammar there, knew no
# usual, and a grammar holding every step at 0.7 s under stall_seconds ran unstopped (sweep 30)
ALONE_EVERY = 300.0
LATENESS_WINDOW = 5.0  # seconds back this process's own worst lag is taken off a reading (a reading takes 2-3 s)
MAX_STRIKE_SECONDS = 86_400.0
MAX_BARRED = 10_000  # grammars kept from such engines at once (the oldest bar dropped first)
MAX_KEYS = 100_000  # keys whose strikes, and unresolved stalls, are kept
MAX_ENDED = 1_000  # requests with a grammar that ended during one stall, kept for its verdict
# what a request's grammar is made of, for its fingerprint
GRAMMAR_FIELDS = (*CONSTRAINT_FIELDS, "response_format", "tools", "tool_choice")


def has_grammar(request: RouteRequest) -> bool:
    """Whether an engine such as llama.cpp follows a grammar for this request: its constraint's, or one it compiles
    from the tools it may call."""
    if request.constraint is not None:
        return True
    return bool(request.body.get("tools")) and request.body.get("tool_choice") != "none"


def _sees_all(reading: LoopReading) -> bool:
    """Whether the engine runs nothing this process did not send it (no other worker's, replica's or client's)."""
    return reading.in_flight is not None and reading.running is not None and 0 <= reading.running <= reading.in_flight


def fingerprint(body: dict[str, Any]) -> bytes:
    parts = {name: body[name] for name in GRAMMAR_FIELDS if name in body}
    try:
        text = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # (an integer past 64 bits)
        text = repr(sorted(parts.items())).encode()
    return hashlib.sha256(text).digest()


@dataclass(slots=True, eq=False)
class Watched:
    """A request with a grammar in flight on a backend whose loop is watched."""

    backend: str
    key: str | None  # its API key's name (None: no keys configured, no key to strike)
    body: dict[str, Any]
    started: float
    stop: Callable[[str], bool] | None = None  # ends its attempt with a reason (set while it is forwarded)
    ended_at: float | None = None
    # its answer came whole: the engine had let it go when it ended here (else it may run there a while more: its
    # client gone, or its attempt stopped)
    finished: bool = False


@dataclass(slots=True)
class _Loop:
    running: list[Watched] = field(default_factory=list)
    # whether each of the last WINDOW readings was slow (a reading waits what is left of the step under way, so a
    # stall of 2 s steps reads anywhere from 0 to 2 s: two in a row missed an 11 s stall, sweep 29's re-run)
    # ... and whether each slow one was a clean step (no prompt read in it: see StallGuard.reading)
    recent: deque[tuple[bool, bool]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    stopped: Watched | None = None  # stopped, its verdict waiting on the readings after it ended
    dropped: bool = False  # the engine let it go (by the time that takes)
    worst: float = 0.0  # the longest step read since it was stopped
    slow_after: int = 0  # readings answered since, all slow
    # the others with a grammar that ran there when it was stopped: one that ends before the verdict may be
    # what the loop's recovery owes to (its client gone, or its answer done)
    beside: list[Watched] = field(default_factory=list)
    # those with a grammar that ended there lately (within the longest the engine takes to let one go) or while
    # the loop was slow (before a stop, or before its verdict): the stall may have been, and gone with, one of
    # them (one whose client left before the first slow reading ran on there, and the victim's was stopped and
    # convicted in its place, sweep 30)
    ended: deque[Watched] = field(default_factory=lambda: deque(maxlen=MAX_ENDED))
    last_reading: float = 0.0  # when the last reading came
    confirmed: bool = False  # this stall was confirmed (CONFIRM_READINGS slow ones)
    wait_until: float = 0.0  # ... and its stop waits until those that ended before it were surely let go
    unseen: bool = False  # a reading in this stall showed the engine run what this process did not send it
    stall_worst: float = 0.0  # the longest step read in this stall
    began: float | None = None  # when its first slow reading came
    fine_at: float = 0.0  # when the last clean reading under the threshold came (the loop fine then)
    slow_at: float = 0.0  # when the last slow reading came
    recovered_at: float = 0.0  # when the first reading under the threshold after it came

    @property
    def streak(self) -> int:
        """The slow readings among the last WINDOW."""
        return sum(slow for slow, _ in self.recent)

    @property
    def stalled(self) -> bool:
        """CONFIRM_READINGS slow among the last WINDOW, one of them at least a clean step: a prompt read is slow
        by nature, and another key's long prompts had a request with a grammar stopped and its key convicted
        (sweep 30)."""
        return self.streak >= CONFIRM_READINGS and any(slow and clean for slow, clean in self.recent)

    def slow(self, clean: bool) -> None:
        self.recent.append((True, clean))


class StallGuard:
    def __init__(self, settings: StallGuardSettings, clock: Clock = SYSTEM,
                 registry: CollectorRegistry | None = None,
                 lateness: Callable[[float], float] | None = None) -> None:
        self.settings = settings
        self._clock = clock
        # the longest this process's own event loop lagged in the last so many seconds (what a reading's time
        # may owe to this process, not to the engine: taken off each reading's)
        self._lateness = lateness
        self._loops: dict[str, _Loop] = {}
        self._keys: dict[str, tuple[float, int]] = {}  # key -> (kept until, strikes)
        self._barred: dict[bytes, float] = {}  # grammar fingerprint -> kept until
        # key -> its requests stopped whose verdicts are to come, and when the last was stopped
        self._pending: dict[str, tuple[int, float]] = {}
        self._usual: dict[str, deque[float]] = {}  # backend -> its loop's last readings outside stalls
        self._alone: dict[str, float] = {}  # backend -> its loop's step with one plain request alone, as measured
        self._alone_asked: dict[str, float] = {}  # backend -> when that was last asked for
        # backend -> whether its last reading's step read a prompt, and the engine's tasks then
        self._last: dict[str, tuple[bool, frozenset[int] | None]] = {}
        # key -> until when it is stopped first: another key's request with a grammar ended as the one stopped
        # did, and the stall went with one of them; the next stall stops its first (sweep 30)
        self._first: dict[str, float] = {}
        self.stops = Counter("gateway_stall_guard_stops", "Requests with a grammar stopped because the loop of "
                             "the engine they ran on stalled, by backend and verdict (cause: the loop answered "
                             "promptly once it ended; not_cause: it did not; unresolved: it did, but other keys' "
                             "such requests ended meanwhile).", ["backend", "verdict"], registry=registry)

    def configure(self, settings: StallGuardSettings) -> None:
        """A reload's settings; turned off, the guard forgets what it holds (strikes, verdicts under way), which
        is how an operator lifts them."""
        self.settings = settings
        if not settings.enabled:
            self._loops.clear()
            self._pending.clear()
            self._keys.clear()
            self._barred.clear()
            self._first.clear()

    # --- asked by the dispatcher ----------------------------------------------------------------------------
    def kept(self, request: RouteRequest, key: str | None) -> tuple[str, float] | None:
        """Why this request may not go to an engine whose loop is watched, and for how many seconds more, if it is
        kept from them."""
        if not self._keys and not self._barred and not self._pending:
            return None
        if not self.settings.enabled or not has_grammar(request):
            return None
        now = self._clock.monotonic()
        held = self._pending.get(key) if key is not None else None
        if key is not None and held is not None:
            if now - held[1] <= HOLD_SECONDS:
                # (one of its requests was stopped, its verdict to come: a key resending as each 503 came had the
                # next admitted before the strike, and stalled the engine again, sweep 29)
                return (f"a request of this key with a grammar was stopped for stalling the loop of an engine that "
                        f"runs every request on one loop (llama.cpp); its requests with a constraint or tools are "
                        f"kept from such engines until that is settled (at most {HOLD_SECONDS:.0f} s)",
                        HOLD_SECONDS - (now - held[1]))
            del self._pending[key]  # (no verdict came: its backend gone, say)
        if key is not None and key in self._keys:
            until, _ = self._keys[key]
            if until > now:
                return (f"a request of this key with a grammar stalled the loop of an engine that runs every "
                        f"request on one loop (llama.cpp); its requests with a constraint or tools are kept from "
                        f"such engines for another {until - now:.0f} s", until - now)
        if self._barred and key is None:
            until = self._barred.get(fingerprint(request.body), 0.0)
            if until > now:
                return (f"this grammar (its constraint and tools) stalled the loop of an engine that runs every "
                        f"request on one loop (llama.cpp); it is kept from such engines for another "
                        f"{until - now:.0f} s", until - now)
        return None

    def watch(self, backend: Backend, request: RouteRequest, key: str | None) -> Watched | None:
        """Note a request sent to ``backend``, if it has a grammar and the backend's loop is watched."""
        if not self.settings.enabled or not backend.spec.load_waits_for_loop or not has_grammar(request):
            return None
        watched = Watched(backend.name, key, request.body, self._clock.monotonic())
        self._loops.setdefault(backend.name, _Loop()).running.append(watched)
        return watched

    def ended(self, watched: Watched, finished: bool = False) -> None:
        """``watched`` ended here; ``finished``: its answer came whole (the engine had let it go)."""
        watched.ended_at = self._clock.monotonic()
        watched.finished = finished
        watched.stop = None
        loop = self._loops.get(watched.backend)
        if loop is None:
            return
        if watched in loop.running:
            loop.running.remove(watched)
        if watched is not loop.stopped:
            loop.ended.append(watched)  # (kept a while: see _Loop.ended; the loop's readings forget it)

    # --- told by the pool ------------------------------------------------------------------------------------
    def stall(self, backend: str, running: int = 1) -> float:
        """The seconds a reading of ``backend``'s loop takes at least to be a stall, with ``running`` sequences
        there: ``stall_factor`` times its usual, or with no usual yet, times its step alone as measured for each
        sequence (a step of several takes at most as long as so many steps alone); at least STALL_FLOOR, at most
        ``stall_seconds``."""
        usual = self._usual.get(backend)
        ceiling = self.settings.stall_seconds
        if usual is None or len(usual) < USUAL_LEAST:
            alone = self._alone.get(backend)
            if alone is None:
                return ceiling
            return min(ceiling, max(STALL_FLOOR, self.settings.stall_factor * alone * max(1, running)))
        ninetieth = sorted(usual)[(len(usual) - 1) * 9 // 10]
        return min(ceiling, max(STALL_FLOOR, self.settings.stall_factor * ninetieth))

    def wants_alone(self, backend: str) -> bool:
        """Whether the pool should measure ``backend``'s loop's step alone now (its engine idle): no usual is known
        yet, and it was not asked for lately."""
        if not self.settings.enabled or not self.settings.measure_alone:
            return False
        usual = self._usual.get(backend)
        if usual is not None and len(usual) >= USUAL_LEAST:
            return False
        now = self._clock.monotonic()
        asked = self._alone_asked.get(backend)
        if asked is not None and now - asked < ALONE_EVERY:
            return False
        if backend not in self._alone_asked and len(self._alone_asked) >= MAX_BACKENDS:
            del self._alone_asked[next(iter(self._alone_asked))]
        self._alone_asked[backend] = now
        return True

    def alone(self, backend: str, seconds: float) -> None:
        """``backend``'s loop's step with one short plain request alone on it, as measured."""
        if backend not in self._alone and len(self._alone) >= MAX_BACKENDS:
            del self._alone[next(iter(self._alone))]
        self._alone[backend] = seconds
        log.info("backend %s: its loop takes %.3f s a step with one plain request alone", backend, seconds)

    def reading(self, reading: LoopReading) -> None:
        """A reading of a backend's loop (see :class:`~gateway.pool.state.LoopReading`). Only a reading of a loop
        at work for requests without a grammar is part of its usual: an idle loop answers at once whatever its
        steps take (a usual learnt idle was ~0, and an honest engine of 0.3 s steps had the first grammar that ran
        alone stopped and convicted), and grammars below the threshold raised it until a worse one passed under
        it (sweep 29). One taken while a sequence read its prompt is held to ``stall_seconds`` alone and is no
        part of the usual: a step is then as long as a batch of prompt takes (skipped, a key's long prompts kept
        its grammar's stall unseen)."""
        step = reading.step
        if self._lateness is not None and step > 0:
            step = max(0.0, step - self._lateness(LATENESS_WINDOW))
        # a clean step read no prompt: none being read now or at the last reading (the step that ends a prompt
        # shows its sequence generating), and no sequence begun since (a prompt of one batch is read in one step)
        before = self._last.pop(reading.backend, (False, None))
        if len(self._last) >= MAX_BACKENDS:
            del self._last[next(iter(self._last))]
        self._last[reading.backend] = (reading.prefilling, reading.tasks)
        began = reading.tasks is not None and before[1] is not None and not reading.tasks <= before[1]
        clean = not (reading.prefilling or before[0] or began)
        # (a reading that timed out is slow whatever the threshold: one raised past what a reading may wait blinded
        # the guard, sweep 30)
        slow = reading.running is None or step >= (self.stall(reading.backend, reading.running) if clean
                                                   else self.settings.stall_seconds)
        loop = self._loops.get(reading.backend)
        if (not slow and clean and reading.running is not None and reading.running > 0 and _sees_all(reading)
                and (loop is None or (loop.stopped is None and not loop.running))):
            # (nothing another process sent runs there: with server.workers 2 a worker learnt its usual while the
            # other's grammar ran there, and grammars under the threshold raised it again, sweep 30)
            if reading.backend not in self._usual and len(self._usual) >= MAX_BACKENDS:
                del self._usual[next(iter(self._usual))]  # (backends found by DNS come and go)
            self._usual.setdefault(reading.backend, deque(maxlen=USUAL_READINGS)).append(step)
        if loop is None:
            return
        now = self._clock.monotonic()
        loop.last_reading = now
        if loop.streak or loop.stopped is not None or slow:
            # (remembered for the whole stall: by its verdict the other process's requests may be gone, and a
            # replica whose only request there was the victim's convicted it, sweep 30)
            loop.unseen = loop.unseen or self._unseen(loop, reading, now)
            if loop.began is None:
                loop.began = now
            if slow:
                loop.stall_worst = max(loop.stall_worst, step if reading.running is not None else MAX_STEP)
                loop.slow_at = now
        stopped = loop.stopped
        if stopped is not None:
            if stopped.ended_at is None:
                return  # its stop is under way
            if slow:
                # (a reading that timed out says only that the step is longer than it could wait: taken as long
                # as steps are counted, since the engine lets go only between two; sweep 29's resent recursive
                # schema, each "[" four times the step before, was acquitted while it still held the engine)
                loop.worst = max(loop.worst, step if reading.running is not None else MAX_STEP)
            if not loop.dropped and now - stopped.ended_at >= DROP_GRACE + DROP_STEPS * min(loop.worst, MAX_STEP):
                # (it looks for a gone client about once a second, and drops it between two steps: past that, let
                # go. Its counts tell nothing: other processes', replicas' and clients' requests are in them, and a
                # request this process has in flight may not have reached it; sweep 29 waited for counts a
                # follower never has, and each decoy stopped first bought the staller 60 s)
                loop.dropped = True
            if not loop.dropped:
                return  # (the engine may still run it: a reading under the threshold then is a step's residue)
            if slow and not clean and now - stopped.ended_at < ACQUIT_SECONDS:
                return  # (a prompt read: slow whatever the stopped request was)
            if not slow:
                # (another key's request with a grammar still running there may have changed its pace as this one
                # was stopped: a schema slow for a few seconds, then cheap, had a victim's stopped and convicted,
                # sweep 30; it is not told apart from the one stopped)
                self._verdict(stopped, self._ended_beside(loop), not loop.unseen, loop.running)
                self._settled(stopped)
                loop.stopped, loop.beside = None, []
                self._calm(loop, reading.backend, now)
                return
            loop.slow_after += 1
            if loop.slow_after < ACQUIT_READINGS and now - stopped.ended_at < ACQUIT_SECONDS:
                return
            if stopped.key is not None and loop.running and all(w.key == stopped.key for w in loop.running):
                # still slow, and every request with a grammar left there is its key's: the stall is that key's
                # either way (one sending the next as each is stopped was acquitted three times, sweep 29)
                self._verdict(stopped, self._ended_beside(loop), not loop.unseen)
                self._settled(stopped)
                loop.stopped, loop.beside = None, []
                loop.recent.extend([(True, True)] * CONFIRM_READINGS)
                for watched in loop.running:
                    if watched.stop is not None:
                        watched.stop(f"the loop of backend {reading.backend} is still slow with only this key's "
                                     "requests with a grammar there")
                return
            self.stops.labels(reading.backend, "not_cause").inc()
            log.info("backend %s: its loop is still slow after a stopped request with a grammar left it; stopping "
                     "the next", reading.backend)
            self._settled(stopped)
            loop.stopped, loop.beside = None, []
            loop.recent.extend([(True, True)] * CONFIRM_READINGS)
        elif not slow:
            if loop.recent and loop.recent[-1][0]:
                loop.recovered_at = now
            loop.recent.append((False, clean))
            if clean:
                loop.fine_at = now
            if loop.confirmed and not any(slow for slow, _ in list(loop.recent)[-2:]):
                # the loop recovered with no request stopped: what ended there lately (its client gone, say) may
                # still have run there until the engine let it go
                self._recovered(loop, reading)
            if not loop.streak:
                self._calm(loop, reading.backend, now)
            return
        else:
            loop.slow(clean)
        if not loop.stalled or not self.settings.enabled:
            return
        if not loop.confirmed:
            loop.confirmed = True
            # one that ended lately (its client gone before the first slow reading) may run there still: its drop
            # is waited for first, once (a request of the next that ends in the wait does not lengthen it)
            window = DROP_GRACE + DROP_STEPS * min(loop.stall_worst, MAX_STEP)
            loop.wait_until = max((w.ended_at + window for w in loop.ended
                                   if not w.finished and w.ended_at is not None), default=0.0)
        if now < loop.wait_until:
            return
        first = {k for k, until in self._first.items() if until > now}
        fine_at = loop.fine_at

        def order(w: Watched) -> tuple[bool, bool, float]:
            # first a key whose request ended as the last stall's stopped one did (the stall going with one of
            # them); then those begun since the loop was last read fine, earliest first (one of them may have
            # begun the stall: a schema slow for a few seconds, then cheap, had the victim's older stream stopped
            # and convicted in its place, sweep 30); then the one running longest (a parse grows with its answer)
            return w.key not in first, w.started < fine_at, w.started

        for watched in sorted(loop.running, key=order):
            if watched.stop is not None and watched.stop(
                    f"the loop of backend {reading.backend}, which runs every request on it, slowed to "
                    f"{step:.1f} s or more a step while this request's grammar (its constraint or tools) ran "
                    f"there; it was stopped (requests with a grammar there are stopped one at a time until the loop "
                    f"recovers): retry, and if it was the cause its key's requests with a grammar are kept from such "
                    f"engines for a while"):
                log.warning("backend %s: its loop took %.1f s or more a step, in %d of its last %d readings, while "
                            "requests with a grammar ran there: stopped one (key %s)",
                            reading.backend, step, loop.streak, len(loop.recent), watched.key or "none")
                loop.stopped, loop.slow_after, loop.dropped, loop.worst = watched, 0, False, step
                if watched.key is not None:
                    count = self._pending.get(watched.key, (0, now))[0]
                    self._pending[watched.key] = (count + 1, now)
                loop.recent.clear()
                loop.beside = [w for w in loop.running if w is not watched]
                return

    @staticmethod
    def _unseen(loop: _Loop, reading: LoopReading, now: float) -> bool:
        """Whether the engine ran, at this reading, what this process did not send it: more than it has in flight
        there and those it ended without their answers lately, which the engine may run still (a reading that timed
        out tells nothing)."""
        if reading.running is None:
            return False
        if reading.in_flight is None or reading.running < 0:
            return True
        lingering = sum(1 for w in (*loop.ended, loop.stopped) if w is not None and w.ended_at is not None
                        and not w.finished and now - w.ended_at < DROP_GRACE + DROP_STEPS * MAX_STEP)
        return reading.running > reading.in_flight + lingering

    def _calm(self, loop: _Loop, backend: str, now: float) -> None:
        """The loop is not stalled (any more): what the stall kept is forgotten, but for those that ended within the
        longest the engine takes to let one go; a loop with nothing left to watch is dropped."""
        loop.confirmed, loop.unseen, loop.stall_worst, loop.wait_until, loop.began = False, False, 0.0, 0.0, None
        loop.recent.clear()
        horizon = now - (DROP_GRACE + DROP_STEPS * MAX_STEP)
        while loop.ended and (loop.ended[0].ended_at or 0.0) < horizon:
            loop.ended.popleft()
        if not loop.running and not loop.ended and loop.stopped is None:
            del self._loops[backend]

    def _recovered(self, loop: _Loop, reading: LoopReading) -> None:
        """The loop recovered from a confirmed stall with no request stopped: one that ended lately was why, if
        they were one key's (or, without keys, whichever of them) and nothing unseen ran there."""
        # (those whose answers came whole before the last slow reading had left the engine while it was still
        # slow, and those after the loop recovered found it fine: neither is why; a tenant's JSON requests that
        # finished in the stall kept the one whose client left unstruck, sweep 30's re-run)
        window = DROP_GRACE + DROP_STEPS * min(loop.stall_worst, MAX_STEP)
        suspects = [w for w in self._ended_beside(loop) if w.ended_at is not None and w.ended_at <= loop.recovered_at
                    and w.ended_at > loop.slow_at - (0.0 if w.finished else window)]
        unseen = loop.unseen
        loop.ended.clear()  # (judged)
        loop.confirmed, loop.unseen, loop.stall_worst, loop.wait_until, loop.began = False, False, 0.0, 0.0, None
        if not suspects:
            return
        keys = {w.key for w in suspects}
        if len(keys) == 1 and not unseen:
            self.stops.labels(reading.backend, "cause").inc()
            self._strike(reading.backend, suspects[0].key, [w.body for w in suspects])
            return
        log.info("backend %s: its loop recovered from a stall as requests with a grammar of %s ended there: no one "
                 "struck", reading.backend, ", ".join(sorted(map(str, keys))))

    def _settled(self, stopped: Watched) -> None:
        """The verdict on ``stopped`` is in: its key is no longer held for it."""
        key = stopped.key
        held = self._pending.get(key) if key is not None else None
        if key is not None and held is not None:
            if held[0] <= 1:
                del self._pending[key]
            else:
                self._pending[key] = (held[0] - 1, held[1])

    @staticmethod
    def _ended_beside(loop: _Loop) -> list[Watched]:
        """Those with a grammar, other than the stopped one, whose end may be why the loop recovered: ended there
        since the stall began, or before it without their answers (the engine may have run them on into it)."""
        seen: dict[int, Watched] = {}
        began = loop.began if loop.began is not None else 0.0
        for watched in (*loop.ended, *loop.beside):
            if (watched.ended_at is not None and watched is not loop.stopped
                    and (watched.ended_at > began or (not watched.finished and watched.ended_at
                                                          > began - (DROP_GRACE + DROP_STEPS * MAX_STEP)))):
                seen[id(watched)] = watched
        return list(seen.values())

    def _verdict(self, stopped: Watched, ended: list[Watched], sees_all: bool,
                 running: list[Watched] | None = None) -> None:
        """The loop answered promptly once ``stopped`` was let go (or, still slow, only its key's requests with a
        grammar are left). It is the cause, and its key struck, where nothing else could be: no other key's request
        with a grammar ``ended`` meanwhile (its answer done, or its client gone), or ended lately, or runs there
        still (its pace may have changed as this one was stopped), and nothing this process did not send ran there
        in the stall (``sees_all``). Otherwise the stall is
        unresolved, and no key is struck for it: counting it against each key among the suspects struck every
        tenant whose requests merely ended as one key's stalls went, and against the stopped one let a key on
        another replica or worker have a victim's request stopped and struck (sweep 30); where another key's such
        request ended, that key's are stopped first at the next stall, where the two are told apart."""
        now = self._clock.monotonic()
        others = {w.key for w in ended} - {stopped.key}
        beside = {w.key for w in running or ()} - {stopped.key}
        if sees_all and not others and not beside:
            self._convict(stopped, also=ended)
            return
        self.stops.labels(stopped.backend, "unresolved").inc()
        for key in others - {None}:
            assert key is not None
            if key not in self._first and len(self._first) >= MAX_KEYS:
                self._first = {k: t for k, t in self._first.items() if t > now}
            self._first[key] = now + self.settings.strike_seconds
        log.info("backend %s: a stall with a stopped request with a grammar (key %s) is unresolved: %s; no one "
                 "struck for it", stopped.backend, stopped.key,
                 f"such requests of {', '.join(sorted(map(str, others)))} ended there meanwhile" if others
                 else f"such requests of {', '.join(sorted(map(str, beside)))} run there still" if beside
                 else "the engine ran requests this process did not send it")

    def _convict(self, watched: Watched, also: list[Watched] | None = None) -> None:
        self.stops.labels(watched.backend, "cause").inc()
        self._strike(watched.backend, watched.key, [watched.body, *(w.body for w in also or ())])

    def _bar(self, grammar: bytes, until: float) -> None:
        now = self._clock.monotonic()
        self._barred = {fp: at for fp, at in self._barred.items() if at > now}
        while len(self._barred) >= MAX_BARRED:
            del self._barred[next(iter(self._barred))]
        self._barred[grammar] = max(until, self._barred.get(grammar, 0.0))

    def _strike(self, backend: str, key: str | None, bodies: list[dict[str, Any]]) -> None:
        """Keep ``key``'s requests with a grammar from such engines, for strike_seconds doubled at each repeat, up
        to a day; with no keys (no auth), the grammars of ``bodies``. A grammar is never kept from other keys: a
        false verdict (an engine's hiccup) barred a common grammar (json_object, a shared tool list) from every
        key (sweep 29); one tenant holds one key."""
        now = self._clock.monotonic()
        if key is None:
            for body in bodies:
                self._bar(fingerprint(body), now + self.settings.strike_seconds)
            log.warning("backend %s: its loop answered promptly once a stopped request with a grammar ended there: "
                        "that grammar kept from such engines for %.0f s", backend, self.settings.strike_seconds)
            return
        until, before = self._keys.get(key, (0.0, 0))
        strikes = before + 1 if until > now - MAX_STRIKE_SECONDS else 1
        if key not in self._keys and len(self._keys) >= MAX_KEYS:
            self._keys = {k: v for k, v in self._keys.items() if v[0] > now - MAX_STRIKE_SECONDS}
        seconds = min(self.settings.strike_seconds * 2 ** (strikes - 1), MAX_STRIKE_SECONDS)
        self._keys[key] = (now + seconds, strikes)
        log.warning("backend %s: its loop answered promptly once a stopped request with a grammar ended there: key "
                    "%s's requests with a grammar kept from such engines for %.0f s", backend, key, seconds)
