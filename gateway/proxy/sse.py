"""Server-sent events relay: upstream bytes in, client bytes out, usage recorded on the way.

Events pass through byte for byte. Only a block that mentions ``"usage"``, ``"timings"`` or ``"error"`` is
split into events and inspected; only an event carrying a usage object is parsed, and only a usage
chunk is ever re-encoded:

* The gateway always asks the upstream for usage. When the client did not, the usage chunk is removed.
* TabbyAPI's usage chunk carries a non-empty ``choices`` entry; it is split into its content (forwarded as
  a normal chunk when it says anything) and a standard usage chunk with ``choices: []``.
* ``\\r\\n`` line endings (TabbyAPI) become ``\\n``; comment pings (``:``) pass through.
"""

from __future__ import annotations

from typing import Any

import orjson

_MARKERS = (b'"usage"', b'"timings"', b'"error"')


def text_events_in(block: bytes) -> int:
    """How many events of an SSE block carry generated text (non-empty ``content`` or ``text``).

    Byte counts, no parsing: inside a JSON string a quote is escaped, so ``"content":"`` only ever matches a
    key. Role-only chunks (``"content":null``), empty finish chunks and usage chunks do not count.
    """
    return (block.count(b'"content":"') - block.count(b'"content":""')
            + block.count(b'"text":"') - block.count(b'"text":""'))


def _has_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(v not in (None, "", []) for k, v in delta.items() if k != "role")


class SSERelay:
    """Feed it upstream bytes; it returns what to send to the client (possibly ``b""``)."""

    __slots__ = ("_buf", "done", "error", "events", "keep_usage", "text_events", "timings", "usage")

    def __init__(self, keep_usage: bool) -> None:
        self.keep_usage = keep_usage
        self._buf = b""
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.error: str | None = None  # message of an error event the upstream sent mid-stream
        self.done = False  # saw data: [DONE]
        self.events = 0
        self.text_events = 0  # events carrying generated text, counted by the caller with text_events_in

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        block, self._buf = buf[: end + 2], buf[end + 2 :]
        self.events += block.count(b"\n\n")
        if b"[DONE]" in block:
            self.done = True
        for marker in _MARKERS:
            if marker in block:
                return self._inspect(block)
        return block

    def flush(self) -> bytes:
        """Whatever the upstream left without a closing blank line, completed into an event."""
        rest, self._buf = self._buf.strip(), b""
        return self.feed(rest + b"\n\n") if rest else b""

    def _inspect(self, block: bytes) -> bytes:
        out: list[bytes] = []
        for event in block.split(b"\n\n"):
            if not event:
                continue
            if not event.startswith(b"data:") or not any(m in event for m in _MARKERS):
                out.append(event)
                continue
            payload = event[5:].strip()
            try:
                doc = orjson.loads(payload)
            except orjson.JSONDecodeError:
                out.append(event)
                continue
            if not isinstance(doc, dict):
                out.append(event)
                continue
            if "error" in doc and "choices" not in doc:
                err = doc["error"]
                self.error = str(err.get("message") if isinstance(err, dict) else err)
            timings = doc.get("timings")
            if isinstance(timings, dict):
                self.timings = timings
            usage = doc.get("usage")
            if not isinstance(usage, dict):
                out.append(event)
                continue
            self.usage = usage
            choices = doc.get("choices")
            if not choices:
                if self.keep_usage:
                    out.append(event)
                continue
            # a usage chunk that also carries choices (TabbyAPI): split it
            content = {k: v for k, v in doc.items() if k != "usage"}
            if any(_has_content(c) for c in choices):
                out.append(b"data: " + orjson.dumps(content))
            if self.keep_usage:
                out.append(b"data: " + orjson.dumps({**content, "choices": [], "usage": usage}))
        return b"".join(e + b"\n\n" for e in out)
