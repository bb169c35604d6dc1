"""``gateway_event_loop_lag_seconds``: how late the event loop runs a timer that is due.

One event loop carries every stream of a gateway process, so anything that holds it (a parse of a large
document, a long collection, a burst of requests' routing) delays every stream's next chunk by as much. A task
asks to wake every ``interval`` seconds and records how much later than due it woke: a stall of 40 ms shows as
one observation of about 40 ms (a stall shorter than the interval may fall between two wake-ups only in part).
This is how the engine scrapes' whole-exposition parses (20-40 ms a second per vLLM backend) were found.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.tasks import cancel_and_wait
from gateway.telemetry.request_metrics import Buckets

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
INTERVAL = 0.05  # seconds between wake-ups: 20 a second, a few microseconds each
NOTED_LAG = 0.01  # lags from this up are kept, with when they ended, for :meth:`LoopLag.worst`


class LoopLag(Collector):
    """Measures the running loop's lag from :meth:`start` to :meth:`stop`; a collector of its histogram."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self.buckets = Buckets(LAG_BUCKETS)
        self._task: asyncio.Task[None] | None = None
        self._noted: deque[tuple[float, float]] = deque(maxlen=256)  # (time.monotonic() it ended, lag)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="event-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait([task])

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        clock, interval, observe, noted = loop.time, self.interval, self.buckets.observe, self._noted
        while True:
            due = clock() + interval
            await asyncio.sleep(interval)
            lag = max(0.0, clock() - due)
            observe(lag)
            if lag >= NOTED_LAG:
                noted.append((time.monotonic(), lag))

    def worst(self, seconds: float) -> float:
        """The longest lag measured in the last ``seconds`` (what this process's own lateness may have added to a
        time it measured then: gateway.proxy.stall_guard)."""
        since = time.monotonic() - seconds
        return max((lag for at, lag in self._noted if at >= since), default=0.0)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "gateway_event_loop_lag_seconds",
            f"How much later than due the event loop ran a timer (one due every {self.interval:g} s): a stall "
            "of the loop delays every stream by as much.")
        family.add_metric([], self.buckets.cumulative(), self.buckets.sum)
        yield family
