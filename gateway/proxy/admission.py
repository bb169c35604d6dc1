"""Admission control: when every eligible backend of a model is at its ``max_concurrency``, requests wait
here for a slot, in priority order and, within a priority, in fair shares between API keys.

The rules (docs/flow-control.md says them for operators):

* **Priority first.** A request's priority is an integer (higher goes first; the named bands ``critical``,
  ``standard`` and ``sheddable`` are 100, 0 and -100 by default). A freed slot goes to the highest priority
  waiting for it. Lower priorities progress whenever the higher ones leave a slot unclaimed: nothing waits
  behind an empty band, and a band that cannot be served in time is told so at once (below) rather than
  held until its deadline.
* **Fair shares within a priority.** Each model's waiters at one priority form a start-time fair queue over
  API keys (anonymous traffic is one key): a request's tag is ``max(virtual time, its key's last finish)``,
  its key's finish moves on by ``1 / weight``, and the smallest tag goes next. Two saturating keys of weights
  3 and 1 are admitted 3:1; a key that floods cannot push a light key's request behind its backlog, since
  the light key's next tag is the queue's current virtual time.
* **No barging.** A request that arrives while requests of its priority or above wait for its model queues
  behind them instead of taking the slot they were woken for.
* **Shedding on predicted wait.** A request's predicted wait is the requests served before it, plus one,
  divided by the model's observed completion rate while busy (idle time is no service time). Past its
  deadline (``x-gateway-deadline-ms``, else its band's ``max_wait_seconds``) it is refused at once with
  ``Retry-After`` = that prediction, and so is a waiting request that higher-priority arrivals have pushed
  past its deadline (the lowest priority is looked at first). With the queue full, an arrival displaces the
  newest waiter of a lower priority, if any.

* **Slots kept for light keys.** A key none of whose requests waits (it keeps up with its own traffic) and
  that was admitted lately has its recent peak of requests in flight plus one kept for it (at most its
  requests in flight plus one, so a key whose burst is over soon keeps little), or, if more, what it will
  likely ask for before the model next frees a slot (its arrivals at its recent rate within the longest
  recent wait between two completions while requests waited: their mean plus two standard deviations, plus
  one): a request of
  another key does not take the last free slots that a light key's next request would need (together at
  most ``reserve_max_share`` of the model's slots), and the light key's request takes one at once, without
  queueing behind the others' backlog. Without it, a light key beside a flood waits for the next slot the
  flood frees on every request. It costs the flooding key those free slots while the light key is active
  (``reserve_window_seconds``).

* **Priority across replicas** (with shared state): each replica tells the others the highest priority waiting
  for a model on it (on every change, and again every ``kick_seconds`` while it lasts); a request yields to a
  higher one waiting elsewhere as it would to one waiting here (it queues, and a woken one waits again instead
  of taking the slot), for at most ``ELSEWHERE_YIELD_SECONDS`` since its arrival, so that a slot the other
  request cannot use (another subset of the model's backends) is not held back for long. An announcement not
  renewed for three ``kick_seconds`` (the replica died) is forgotten. Fair shares between keys of one priority
  stay each replica's own.

A woken waiter routes again; if another request was quicker it waits again with its original tag (ahead of
its key's later requests). Waiting is in slices: a waiter looks again after ``slice`` seconds even when no
release woke it (a backend that came up frees slots no release announces).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.clock import SYSTEM, Clock
from gateway.config import AdmissionSettings, ApiKeySettings
from gateway.errors import GatewayError
from gateway.pool.backend import Backend

RATE_WINDOW_SECONDS = 30.0  # completions older than this no longer count toward a model's service rate
RATE_MIN_COMPLETIONS = 4  # fewer recent completions: the rate is unknown and nothing is shed on a guess


MAX_DEADLINE_MS = 3_600_000
ELSEWHERE_YIELD_SECONDS = 5.0
# per-second entries (a key's peaks, a model's gaps) kept at most: the longest reserve_window_seconds (its config
# bound), plus the second under way; pruned by age where read, bounded here where nothing reads them (the
# reserve for light keys off, or one key alone)
PER_SECOND_MAX = 301  # the longest a request yields to higher priorities waiting on other replicas


@dataclass(frozen=True, slots=True)
class Placement:
    """What admission needs of a request: its priority, its key's weight and how long it may wait."""

    priority: int
    band: str
    weight: float
    max_wait: float
    max_saturation: float | None = None  # its band's: admitted only below this share of the model's slots


class Priorities:
    """A request's :class:`Placement`, from its key's settings and its ``x-gateway-priority`` and
    ``x-gateway-deadline-ms`` headers. A key's priority is its own or admission's default; the header may ask
    for any priority up to the key's ``max_priority`` (default: its own: the header can only lower it).
    Anonymous traffic is one tenant at the default priority. The deadline shortens the wait, never lengthens
    it past the band's ``max_wait_seconds``."""

    def __init__(self, settings: AdmissionSettings, keys: Iterable[ApiKeySettings]) -> None:
        self.settings = settings
        default = settings.priority_of(settings.default_priority)
        self._anonymous = (default, default, 1.0)
        self._keys: dict[str, tuple[int, int, float]] = {}
        for key in keys:
            own = settings.priority_of(key.priority) if key.priority is not None else default
            ceiling = settings.priority_of(key.max_priority) if key.max_priority is not None else own
            self._keys[key.name] = (own, ceiling, key.weight)
        self._plain = {name: self._placement(own, weight, None) for name, (own, _, weight) in self._keys.items()}
        self._plain_anonymous = self._placement(default, 1.0, None)

    def _placement(self, priority: int, weight: float, deadline: float | None) -> Placement:
        max_wait = self.settings.max_wait_of(priority)
        if deadline is not None:
            max_wait = min(max_wait, deadline)
        return Placement(priority, self.settings.band_of(priority), weight, max_wait,
                         self.settings.max_saturation_of(priority))

    def place(self, key: str | None, priority_header: bytes | None, deadline_header: bytes | None) -> Placement:
        if priority_header is None and deadline_header is None:  # (the common case: nothing to parse)
            plain = self._plain.get(key) if key is not None else None
            return plain if plain is not None else self._plain_anonymous
        own, ceiling, weight = self._keys.get(key, self._anonymous) if key is not None else self._anonymous
        priority = own
        if priority_header is not None:
            text = priority_header.decode("latin-1").strip()
            try:
                priority = self.settings.priority_of(int(text) if _is_int(text) else text, "x-gateway-priority")
            except ValueError as exc:
                raise GatewayError(400, str(exc),
                                   code="invalid_priority", param="x-gateway-priority") from None
            if priority > ceiling:
                raise GatewayError(403, f"x-gateway-priority: this key may ask for priority {ceiling} at most "
                                        f"(asked {priority})", code="priority_not_allowed",
                                   param="x-gateway-priority")
        deadline = None
        if deadline_header is not None:
            text = deadline_header.decode("latin-1").strip()
            if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= MAX_DEADLINE_MS:
                raise GatewayError(400, f"x-gateway-deadline-ms: a whole number of milliseconds in "
                                        f"[1, {MAX_DEADLINE_MS}], not {text[:40]!r}", code="invalid_deadline",
                                   param="x-gateway-deadline-ms")
            deadline = int(text) / 1000.0
        return self._placement(priority, weight, deadline)


def _is_int(text: str) -> bool:
    digits = text.lstrip("+-")  # (ASCII digits only: "²".isdigit() is true, and int("²") raises)
    return digits.isascii() and digits.isdigit() and len(text) <= 8


class Refused(Exception):
    """The request leaves the queue unserved. ``reason``: ``queue_full`` (no place, none lower to displace),
    ``displaced`` (a higher priority took its place), ``deadline`` (the predicted wait exceeds what it may
    wait), ``timeout`` (it waited its whole deadline). ``predicted``: the predicted wait, seconds, if known."""

    def __init__(self, reason: str, predicted: float | None, ahead: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.predicted = predicted
        self.ahead = ahead


@dataclass(eq=False)
class Ticket:
    """One request's place in admission, kept across its routing attempts."""

    model: str
    key: str
    priority: int
    weight: float
    deadline: float  # the admission clock's monotonic time after which it may no longer be admitted
    arrived: float = 0.0  # (the admission clock's monotonic time)
    tag: float | None = None  # its start tag once it has queued
    state: str = "new"  # new -> queued -> woken (-> queued ...) -> done
    woken: asyncio.Future[None] | None = None
    refused: Refused | None = None  # set when it is shed or displaced while it waits
    waited: bool = False  # it queued at least once
    max_saturation: float | None = None  # admitted only while its model's slots in use are below this share
    admitted_at: float = 0.0  # (likewise) when it got its backend
    chain: bool = False  # woken with no slot announced (another replica's higher waiter left): admitted, it
    # wakes the next, for the slots that were freed while they all yielded


class _Level:
    """One model's waiters at one priority: a start-time fair queue over keys."""

    __slots__ = ("finish", "keys", "vtime")

    def __init__(self) -> None:
        self.vtime = 0.0
        self.keys: dict[str, deque[Ticket]] = {}
        self.finish: dict[str, float] = {}  # key -> the finish tag of its last queued request

    def __len__(self) -> int:
        return sum(len(q) for q in self.keys.values())

    def push(self, ticket: Ticket) -> None:
        queue = self.keys.get(ticket.key)
        if queue is None:
            queue = self.keys[ticket.key] = deque()
        if ticket.tag is None:  # a new waiter
            start = max(self.vtime, self.finish.get(ticket.key, 0.0))
            ticket.tag = start
            self.finish[ticket.key] = start + 1.0 / ticket.weight
            queue.append(ticket)
        else:  # woken, and beaten to the slot: back where its tag says (the front, as a rule)
            position = 0
            while position < len(queue) and (queue[position].tag or 0.0) <= ticket.tag:
                position += 1
            queue.insert(position, ticket)
            self.finish[ticket.key] = max(self.finish.get(ticket.key, 0.0), ticket.tag + 1.0 / ticket.weight)

    def head(self) -> Ticket | None:
        best: Ticket | None = None
        for queue in self.keys.values():
            first = queue[0]
            if best is None or (first.tag or 0.0) < (best.tag or 0.0):
                best = first
        return best

    def pop(self) -> Ticket | None:
        best = self.head()
        if best is not None:
            self.remove(best)
            self.vtime = max(self.vtime, best.tag or 0.0)
        return best

    def remove(self, ticket: Ticket) -> None:
        queue = self.keys[ticket.key]
        queue.remove(ticket)
        if not queue:
            del self.keys[ticket.key]
            if self.finish.get(ticket.key, 0.0) <= self.vtime:
                self.finish.pop(ticket.key, None)

    def ahead_of(self, ticket: Ticket) -> int:
        """Waiters of this level served before ``ticket`` (by tag), in O(keys): along a key's queue the tags
        step by ``1 / weight`` from its head's (a requeued waiter aside), so the count below a tag is read off
        the head's tag and the weight."""
        tag = ticket.tag or 0.0
        count = 0
        for key, queue in self.keys.items():
            if key == ticket.key:
                count += len(queue) - 1 if queue[-1] is ticket else queue.index(ticket)
                continue
            head = queue[0]
            first = head.tag or 0.0
            if first <= tag:
                count += min(len(queue), int((tag - first) * head.weight) + 1)
        return count

    def last(self) -> Ticket | None:
        """The waiter served last (the largest tag)."""
        worst: Ticket | None = None
        for queue in self.keys.values():
            tail = queue[-1]
            if worst is None or (tail.tag or 0.0) >= (worst.tag or 0.0):
                worst = tail
        return worst


class _Use:
    """One key's requests of one model admitted here: in flight now, and per second lately the most in flight
    and how many were admitted."""

    __slots__ = ("active", "peaks", "service")

    def __init__(self) -> None:
        self.active = 0
        # [second, the most in flight during it, admissions during it], oldest first
        self.peaks: deque[list[int]] = deque(maxlen=PER_SECOND_MAX)
        self.service: float | None = None  # how long its requests hold a slot (a moving average), once one ended

    def served(self, seconds: float) -> None:
        self.service = seconds if self.service is None else self.service + (seconds - self.service) / 4

    def admitted(self, now: float) -> None:
        self.active += 1
        second = int(now)
        if self.peaks and self.peaks[-1][0] == second:
            last = self.peaks[-1]
            last[1] = max(last[1], self.active)
            last[2] += 1
        else:
            self.peaks.append([second, self.active, 1])

    def busy(self, now: float, window: float, gap: float) -> float:
        """The slots its requests likely hold at once (Little's law: its admission rate over ``window`` times how
        long one holds a slot, ``gap`` until one has ended), or what it holds now if more."""
        peaks = self.peaks
        admitted = sum(p[2] for p in peaks if p[0] + 1 >= now - window)
        held = self.service if self.service is not None else gap
        return max(float(self.active), admitted / window * held)

    def kept(self, now: float, window: float, gap: float = 0.0) -> int:
        """Slots kept free for this key (0 when it was not admitted within ``window`` and has nothing in flight),
        the more of two needs:

        * its recent peak in flight (or what it has now, if more) plus one, less what it has in flight, and
          never more than it has in flight plus one (a key whose burst is ending keeps little);
        * what it will likely ask for before the model frees a slot: at its admission rate over ``window``,
          its arrivals within ``gap`` (the longest recent wait between two of the model's completions while
          requests waited), or within the time one of its requests holds a slot if that is shorter (its
          requests in flight at once: Little's law), their mean plus two standard deviations (Poisson), plus
          one. Without it a light key at its peak has one slot kept, and its second request in a gap waits the
          gap out; without the shorter time, a key sending a 3 ms request every 4 s had half a flooded
          model's slots kept idle for it (sweep 13: the flood's throughput halved)."""
        peaks = self.peaks
        while peaks and peaks[0][0] + 1 < now - window:  # (a second's peak lasts until its end is that old)
            peaks.popleft()
        if not peaks and not self.active:
            return 0
        peak = max(max((p[1] for p in peaks), default=0), self.active)
        kept = min(peak + 1 - self.active, self.active + 1)
        span = gap if self.service is None else min(gap, self.service)
        if span > 0 and peaks:
            mean = sum(p[2] for p in peaks) / window * span
            kept = max(kept, math.ceil(mean + 2 * math.sqrt(mean)) + 1)
        return kept


class _Model:
    """One model's queue: its priority levels, its woken-but-not-yet-routed waiters, its service rate and its
    keys' use of its slots. (Kept for the process's life: only models that routed a request have one.)"""

    __slots__ = ("active", "busy_after", "busy_seconds", "gaps", "intervals", "last_busy", "last_completion",
                 "levels", "uses", "woken")

    def __init__(self) -> None:
        self.levels: dict[int, _Level] = {}
        self.woken: list[Ticket] = []  # woken, still routing: a slot was freed for each
        # The service rate's samples: the time between two completions while the model was busy throughout
        # (requests in flight or waiting after the first), as (the second completion, seconds), oldest first.
        # Time with nothing to serve is no service: an idle model's last few completions must not make its
        # next burst look slow (4 completions over 25 s idle predicted 6.3 s for a 0.4 s wait).
        self.intervals: deque[tuple[float, float]] = deque(maxlen=256)
        self.busy_seconds = 0.0  # their sum
        self.last_completion: float | None = None
        self.busy_after = False  # was it busy right after the last completion?
        # waits between two completions while requests waited: [second, the longest ending in it], oldest first
        self.gaps: deque[list[float]] = deque(maxlen=PER_SECOND_MAX)
        self.last_busy: float | None = None  # the last completion while requests waited, until one without
        self.active = 0  # admitted through this admission and not yet finished
        self.uses: dict[str, _Use] = {}  # by key

    def waiting_keys(self) -> set[str]:
        keys = {t.key for t in self.woken}
        for level in self.levels.values():
            keys.update(level.keys)
        return keys

    def priorities(self) -> list[int]:
        return sorted(self.levels, reverse=True)

    def queued(self) -> int:
        return sum(len(level) for level in self.levels.values())

    def waiting(self) -> bool:
        return bool(self.woken or any(level.keys for level in self.levels.values()))

    def busy(self) -> bool:
        return bool(self.active) or self.waiting()

    def completion(self, at: float) -> None:
        waiting = self.waiting()
        last = self.last_completion
        if last is not None and self.busy_after and at > last:
            intervals = self.intervals
            if len(intervals) == intervals.maxlen:
                self.busy_seconds -= intervals[0][1]
            intervals.append((at, at - last))
            self.busy_seconds += at - last
        if last is None or at >= last:
            self.last_completion = at
            self.busy_after = bool(self.active) or waiting
        if not waiting:
            self.last_busy = None  # (a slot freed with nobody waiting: no wait between frees to measure)
            return
        if self.last_busy is not None and at > self.last_busy:
            gap, second = at - self.last_busy, int(at)
            if self.gaps and self.gaps[-1][0] == second:
                self.gaps[-1][1] = max(self.gaps[-1][1], gap)
            else:
                self.gaps.append([second, gap])
        self.last_busy = at

    def longest_gap(self, now: float, window: float) -> float:
        """The longest wait between two completions while requests waited, over the last ``window`` seconds."""
        gaps = self.gaps
        while gaps and gaps[0][0] + 1 < now - window:
            gaps.popleft()
        return max((g for _, g in gaps), default=0.0)

    def rate(self, now: float) -> float | None:
        """Completions per second of busy time over the last RATE_WINDOW_SECONDS (None: too few to say). The
        time since the last completion counts while the model is busy, so a model whose requests stopped
        finishing sees its rate fall."""
        intervals = self.intervals
        while intervals and now - intervals[0][0] > RATE_WINDOW_SECONDS:
            self.busy_seconds -= intervals.popleft()[1]
        if not intervals:
            self.busy_seconds = 0.0  # (no drift from the running sum)
        if len(intervals) < RATE_MIN_COMPLETIONS:
            return None
        busy = self.busy_seconds
        if self.last_completion is not None and self.busy_after and self.busy():
            busy += max(0.0, now - self.last_completion)
        return len(intervals) / busy if busy > 0 else None


class Admission:
    def __init__(self, settings: AdmissionSettings, kick_seconds: float = 1.0, clock: Clock = SYSTEM) -> None:
        self.settings = settings
        # its waits are the event loop's (asyncio timeouts): a clock whose monotonic time is not the loop's
        # (a test's manual one) suits only the methods that do not wait
        self.clock = clock
        self.kick_seconds = kick_seconds
        self._kicker: asyncio.Task[None] | None = None
        self._models: dict[str, _Model] = {}
        self.waiting = 0  # queued across models (woken ones not counted)
        self._places: dict[str, int] = {}  # key -> its requests among them
        # slots freed so far (here or, with shared state, anywhere): a request that found every backend full
        # while this moved should look again at once, since the wake-up it would wait for has already passed
        self.generation = 0
        # with shared state: announce(model, priority or None), the highest priority waiting here for a model
        self.announce: Callable[[str, int | None], None] | None = None
        self._announced: dict[str, int | None] = {}
        # model -> replica -> (the highest priority waiting there, until when the announcement holds)
        self._elsewhere: dict[str, dict[str, tuple[int, float]]] = {}

    # -- a request's life -------------------------------------------------------------------------------------
    def ticket(self, model: str, key: str, placement: Placement) -> Ticket:
        now = self.clock.monotonic()
        return Ticket(model, key, placement.priority, placement.weight, now + placement.max_wait, arrived=now,
                      max_saturation=placement.max_saturation)

    def should_queue(self, ticket: Ticket) -> bool:
        """Requests of ``ticket``'s priority or above wait (or were just woken) for its model, or a higher one
        waits on another replica: it goes behind them rather than taking the slot they are owed; unless its key
        is a light one with a slot kept for it."""
        state = self._models.get(ticket.model)
        if state is None:
            return self.outranked(ticket)
        priority = ticket.priority
        if not (any(w.priority >= priority for w in state.woken)
                or any(p >= priority and state.levels[p].keys for p in state.levels)):
            return self.outranked(ticket)  # (which lets a light key with a slot kept for it through itself)
        return not (self.settings.reserve_for_light_keys and self._kept_for(state, ticket.key, self.clock.monotonic()))

    def admitted(self, ticket: Ticket) -> None:
        """The request got its backend: it leaves the queue and counts as active until :meth:`released`. One
        that found its slot on its own (no release woke it: a backend came up, or another replica freed it)
        wakes the next waiter too, which looks for another such slot."""
        own = ticket.state == "queued" or ticket.chain
        self._leave(ticket)
        state = self._model(ticket.model)
        state.active += 1
        use = state.uses.get(ticket.key)
        if use is None:
            use = state.uses[ticket.key] = _Use()
        ticket.admitted_at = self.clock.monotonic()
        use.admitted(ticket.admitted_at)
        if own and self.waiting:
            self._wake_in(state)

    def is_next(self, ticket: Ticket) -> bool:
        """``ticket`` is the waiter its model's next freed slot goes to."""
        state = self._models.get(ticket.model)
        if state is None or ticket.state != "queued":
            return False
        for priority in state.priorities():
            head = state.levels[priority].head()
            if head is not None:
                return head is ticket
        return False

    def abandon(self, ticket: Ticket) -> None:
        """The request leaves without a backend (refused, failed, client gone)."""
        self._leave(ticket)

    async def wait(self, ticket: Ticket) -> None:
        """Queue ``ticket`` (or keep its place) until it is woken: a slot may be free for its model (the caller
        routes again). Raises :class:`Refused` when it cannot be served within its deadline, or was
        displaced."""
        if ticket.refused is not None:  # (shed or displaced while it was routing)
            raise ticket.refused
        now = self.clock.monotonic()
        if now >= ticket.deadline:
            raise self._refuse(ticket, "timeout", now)
        state = self._model(ticket.model)
        if ticket.state != "queued":
            if ticket.state == "woken":
                state.woken.remove(ticket)
                ticket.chain = False
            elif self.waiting >= self.settings.queue_size and not self._displace(ticket, now):
                raise self._refuse(ticket, "queue_full", now)
            level = state.levels.get(ticket.priority)
            if level is None:
                level = state.levels[ticket.priority] = _Level()
            level.push(ticket)
            ticket.state = "queued"
            ticket.waited = True
            self.waiting += 1
            self._places[ticket.key] = self._places.get(ticket.key, 0) + 1
            self._changed(ticket.model)
            if self.settings.shed_on_predicted_wait:
                predicted, ahead = self._predict(state, ticket, now)
                if predicted is not None and predicted > ticket.deadline - now:
                    self._dequeue(ticket)
                    raise Refused("deadline", predicted, ahead)
                self._shed_lower(state, ticket.priority, now)
        loop = asyncio.get_running_loop()
        if self._kicker is None or self._kicker.done():
            self._kicker = loop.create_task(self._kick())
        ticket.woken = loop.create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(ticket.woken), max(0.0, ticket.deadline - now))
        if ticket.refused is not None:
            raise ticket.refused
        if ticket.state == "queued":  # (its deadline passed)
            raise self._refuse(ticket, "timeout", self.clock.monotonic())

    async def _kick(self) -> None:
        """While requests wait: every ``kick_seconds``, wake each model's first waiter even though no release
        announced a slot (a backend that came up, or a free-slot message lost with a Redis connection); if it
        finds one, its admission wakes the next (see :meth:`admitted`). One timer per admission, not one per
        waiter."""
        while self.waiting:
            await self.clock.sleep(self.kick_seconds)
            for model, state in list(self._models.items()):
                if self.announce is not None and self._announced.get(model) is not None:
                    self.announce(model, self._announced[model])  # (renewed, or the others forget it)
                if not state.woken and any(level.keys for level in state.levels.values()):
                    self._wake_in(state)

    def finished(self, ticket: Ticket) -> None:
        """An admitted request ended (answered or not): it no longer counts as active, and its end counts
        toward its model's service rate."""
        state = self._model(ticket.model)
        state.active -= 1
        use = state.uses.get(ticket.key)
        if use is not None:
            use.active -= 1
            if ticket.admitted_at:
                use.served(self.clock.monotonic() - ticket.admitted_at)
            if not use.active and len(state.uses) > 64:  # (keys seen once long ago: let them go)
                now = self.clock.monotonic()
                for key in [k for k, u in state.uses.items() if not u.kept(now, self.settings.reserve_window_seconds)]:
                    del state.uses[key]
        self.completed(ticket.model)

    def completed(self, model: str, at: float | None = None) -> None:
        """A request of ``model`` ended at ``at`` (the clock's monotonic time, default now): its service rate."""
        self._model(model).completion(self.clock.monotonic() if at is None else at)

    def released(self, backend: Backend) -> None:
        """An attempt on ``backend`` ended: wake the best waiter whose model ``backend`` serves."""
        self.generation += 1
        if self.waiting:
            self._wake(backend)

    def freed(self, backends: Iterable[Backend]) -> None:
        """A slot was freed in the shared state on one of ``backends`` (by any replica): a waiter may route
        again."""
        self.generation += 1
        for backend in backends:
            if not self.waiting:
                return
            self._wake(backend)

    def outranked(self, ticket: Ticket) -> bool:
        """A higher priority than ``ticket``'s waits for its model on another replica (as it last said), and
        ``ticket`` has not yet yielded for ELSEWHERE_YIELD_SECONDS, nor is it of a light key with a slot kept
        for it: it should wait rather than take a slot."""
        others = self._elsewhere.get(ticket.model)
        if not others:
            return False
        now = self.clock.monotonic()
        if now - ticket.arrived >= ELSEWHERE_YIELD_SECONDS:
            return False
        state = self._models.get(ticket.model)
        if state is not None and self.settings.reserve_for_light_keys and self._kept_for(state, ticket.key, now):
            return False  # (a light key takes what is kept for it, as it would here)
        for replica, (priority, until) in list(others.items()):
            if until <= now:
                del others[replica]  # (not renewed: that replica is gone, or its message was lost)
            elif priority > ticket.priority:
                return True
        return False

    def elsewhere(self, replica: str, model: str, priority: int | None) -> None:
        """Another replica's announcement: ``priority`` is the highest waiting there for ``model`` (None:
        nothing waits there any more). When it falls, the first waiter here looks again for a slot."""
        others = self._elsewhere.setdefault(model, {})
        before = others.get(replica)
        if priority is None:
            others.pop(replica, None)
        else:
            others[replica] = (priority, self.clock.monotonic() + 3 * self.kick_seconds)
        if before is not None and (priority is None or priority < before[0]):
            state = self._models.get(model)
            if state is not None and not state.woken and self.waiting:
                self._wake_in(state, chain=True)

    def _changed(self, model: str) -> None:
        """The waiters of ``model`` changed: announce their highest priority if it moved."""
        if self.announce is None:
            return
        top = self._top(model)
        if self._announced.get(model) != top:
            self._announced[model] = top
            self.announce(model, top)

    def _top(self, model: str) -> int | None:
        state = self._models.get(model)
        if state is None:
            return None
        top = max((p for p, level in state.levels.items() if level.keys), default=None)
        for woken in state.woken:
            if top is None or woken.priority > top:
                top = woken.priority
        return top

    def held_back(self, ticket: Ticket, capacity_of: Callable[[str], tuple[int, int] | None]) -> bool:
        """Taking one of the model's free slots (``capacity_of(model)``: its slots and how many are free) now
        would take one kept for a light key other than ``ticket``'s (see the module's rules): the request waits
        like one that found every backend full."""
        if not self.settings.reserve_for_light_keys:
            return False
        state = self._models.get(ticket.model)
        if state is None or not state.uses or (len(state.uses) == 1 and ticket.key in state.uses):
            return False  # (one key alone: the common case, decided before anything is counted)
        now = self.clock.monotonic()
        waiting = state.waiting_keys()
        window = self.settings.reserve_window_seconds
        gap = state.longest_gap(now, window)
        own = state.uses.get(ticket.key)
        if own is not None and ticket.key not in waiting and own.kept(now, window, gap):
            return False  # a light key takes what is kept for it
        light = [use for key, use in state.uses.items() if key != ticket.key and key not in waiting]
        kept = sum(use.kept(now, window, gap) for use in light)
        if not kept:
            return False
        # and no more free than what the light keys together likely hold at once (mean plus two standard
        # deviations) less what they hold now, at least one: each key's own margin, summed, kept two idle slots for
        # every key seen in the window, however little it used (sweep 14: one key sending a 3 ms request every 4
        # s cost a flood of 8 slots a quarter of its throughput, four keys half); and the slots they held were
        # counted again as kept free (sweep 15: a key holding one slot had up to three more kept idle)
        busy = sum(use.busy(now, window, gap) for use in light)
        held = sum(use.active for use in light)
        kept = min(kept, max(1, math.ceil(busy + 2 * math.sqrt(busy)) - held))
        capacity = capacity_of(ticket.model)
        if not capacity:
            return False
        slots, free = capacity
        kept = min(kept, int(slots * self.settings.reserve_max_share))
        return free - 1 < kept

    def _kept_for(self, state: _Model, key: str, now: float) -> bool:
        """``key`` is light (none of its requests waits) and has a slot kept for it."""
        use = state.uses.get(key)
        window = self.settings.reserve_window_seconds
        if use is None or not use.kept(now, window, state.longest_gap(now, window)):
            return False
        return key not in state.waiting_keys()

    # -- what operators and autoscalers read ---------------------------------------------------------------
    def depth(self) -> dict[tuple[str, int], int]:
        """Queued requests by (model, priority)."""
        return {(model, p): len(level) for model, state in self._models.items()
                for p, level in state.levels.items() if level.keys}

    def active(self, model: str) -> int:
        state = self._models.get(model)
        return state.active if state is not None else 0

    def queued(self, model: str) -> int:
        state = self._models.get(model)
        return state.queued() if state is not None else 0

    def models(self) -> list[str]:
        return list(self._models)

    def service_rate(self, model: str) -> float | None:
        state = self._models.get(model)
        return state.rate(self.clock.monotonic()) if state is not None else None

    # -- inside -------------------------------------------------------------------------------------------
    def _model(self, model: str) -> _Model:
        state = self._models.get(model)
        if state is None:
            state = self._models[model] = _Model()
        return state

    def _wake(self, backend: Backend) -> None:
        best: tuple[int, float] | None = None
        chosen: _Model | None = None
        for model, state in self._models.items():
            if model not in backend.models:
                continue
            for priority in state.priorities():
                head = state.levels[priority].head()
                if head is None:
                    continue
                rank = (priority, -head.arrived)
                if best is None or rank > best:
                    best, chosen = rank, state
                break  # (the first level with waiters is this model's best)
        if chosen is not None:
            self._wake_in(chosen)

    def _wake_in(self, state: _Model, chain: bool = False) -> None:
        """Wake ``state``'s next waiter: the head of its highest level with waiters (``chain``: see Ticket)."""
        for priority in state.priorities():
            level = state.levels[priority]
            if level.keys:
                break
        else:
            return
        ticket = level.pop()
        assert ticket is not None
        self._drop_empty(state, ticket.priority)
        self.waiting -= 1
        self._gave_place(ticket.key)
        ticket.state = "woken"
        ticket.chain = chain
        state.woken.append(ticket)
        if ticket.woken is not None and not ticket.woken.done():
            ticket.woken.set_result(None)

    def _predict(self, state: _Model, ticket: Ticket, now: float) -> tuple[float | None, int]:
        """(predicted wait in seconds or None, requests served before ``ticket``)."""
        ahead = sum(1 for w in state.woken if w.priority >= ticket.priority)
        for priority, above in state.levels.items():
            if priority > ticket.priority:
                ahead += len(above)
        own = state.levels.get(ticket.priority)
        if own is not None and ticket.state == "queued":
            ahead += own.ahead_of(ticket)
        rate = state.rate(now)
        return ((ahead + 1) / rate if rate else None), ahead

    def _shed_lower(self, state: _Model, priority: int, now: float) -> None:
        """An arrival at ``priority`` pushed every lower waiter back by one: refuse, lowest priority first,
        those that can no longer be served within their deadlines."""
        for lower in sorted(p for p in state.levels if p < priority):
            while True:
                level = state.levels.get(lower)
                last = level.last() if level is not None else None
                if last is None:
                    break
                predicted, ahead = self._predict(state, last, now)
                if predicted is None or predicted <= last.deadline - now:
                    break
                self._dequeue(last)
                self._notify(last, Refused("deadline", predicted, ahead))

    def _displace(self, ticket: Ticket, now: float) -> bool:
        """The queue is full: take the place of the newest waiter of the lowest priority below ``ticket``'s;
        else, of the newest waiter, at ``ticket``'s priority or below, of the key holding the most places, when
        that key holds more than ``ticket``'s key would with it. The queue is shared by every key, and a key's
        share of it is what it leaves the others: one key filling it (a thousand requests waiting on a model it
        kept slow) had every other key's requests refused at once, on every model (sweep 16)."""
        for candidate in sorted(self._models.values(), key=lambda s: min(s.levels, default=0)):
            lower = [p for p in candidate.levels if p < ticket.priority and candidate.levels[p].keys]
            if not lower:
                continue
            victim = candidate.levels[min(lower)].last()
            assert victim is not None
            self._displaced(candidate, victim, now)
            return True
        if not self._places:
            return False
        biggest = max(self._places, key=self._places.__getitem__)
        if self._places[biggest] <= self._places.get(ticket.key, 0) + 1:
            return False
        newest: tuple[_Model, Ticket] | None = None
        for candidate in self._models.values():
            for priority, level in candidate.levels.items():
                queue = level.keys.get(biggest)
                if priority <= ticket.priority and queue and (newest is None or queue[-1].arrived > newest[1].arrived):
                    newest = candidate, queue[-1]
        if newest is None:
            return False
        self._displaced(*newest, now)
        return True

    def _displaced(self, state: _Model, victim: Ticket, now: float) -> None:
        predicted, ahead = self._predict(state, victim, now)
        self._dequeue(victim)
        self._notify(victim, Refused("displaced", predicted, ahead))

    def _gave_place(self, key: str) -> None:
        left = self._places[key] - 1
        if left:
            self._places[key] = left
        else:
            del self._places[key]

    def _dequeue(self, ticket: Ticket) -> None:
        state = self._models[ticket.model]
        state.levels[ticket.priority].remove(ticket)
        self._drop_empty(state, ticket.priority)
        self.waiting -= 1
        self._gave_place(ticket.key)
        ticket.state = "new"
        self._changed(ticket.model)

    def _drop_empty(self, state: _Model, priority: int) -> None:
        level = state.levels.get(priority)
        if level is not None and not level.keys and not level.finish:
            del state.levels[priority]

    def _notify(self, ticket: Ticket, refused: Refused) -> None:
        ticket.refused = refused
        ticket.state = "done"
        if ticket.woken is not None and not ticket.woken.done():
            ticket.woken.set_result(None)

    def _refuse(self, ticket: Ticket, reason: str, now: float) -> Refused:
        state = self._models.get(ticket.model)
        predicted, ahead = self._predict(state, ticket, now) if state is not None else (None, 0)
        self._leave(ticket)
        return Refused(reason, predicted, ahead)

    def _leave(self, ticket: Ticket) -> None:
        state = self._models.get(ticket.model)
        if ticket.state == "queued":
            self._dequeue(ticket)
        elif ticket.state == "woken" and state is not None:
            state.woken.remove(ticket)
            self._changed(ticket.model)
        ticket.state = "done"
        if ticket.woken is not None and not ticket.woken.done():
            ticket.woken.cancel()


def retry_after(refused: Refused) -> int:
    """Whole seconds for ``Retry-After``: the predicted wait, at least 1."""
    return max(1, math.ceil(refused.predicted)) if refused.predicted is not None else 1
