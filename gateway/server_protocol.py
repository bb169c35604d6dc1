"""uvicorn's httptools protocol, stamping each request's arrival.

A request's clock (time to first token, queue wait, duration) must start when its bytes are parsed, not when
the event loop gets round to running the ASGI app: under a burst the app task of the last request of
twelve starts ~10 ms after it arrived on our 2-core machines, and that wait is latency the client sees.
The stamp travels in ``scope["state"]["gateway.arrival"]`` (``time.perf_counter()``).
"""

from __future__ import annotations

import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

ARRIVAL = "gateway.arrival"


class StampedHttpToolsProtocol(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["state"][ARRIVAL] = time.perf_counter()
