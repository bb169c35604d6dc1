"""Server-sent events relay: upstream bytes in, client bytes out, every event checked on the way.

Each event must be an SSE comment (``:`` ping) or a ``data:`` event carrying a JSON object or ``[DONE]``;
anything else (HTML, a truncated JSON line, bytes that are not SSE) raises :class:`InvalidStream`, so the
client never receives a malformed event: the proxy ends its stream with an OpenAI error event instead (or,
before the first byte, tries another backend). Valid events pass through byte for byte; only a usage chunk
is ever re-encoded:

* The gateway always asks the upstream for usage. When the client did not, the usage chunk is removed.
* TabbyAPI's usage chunk carries a non-empty ``choices`` entry; it is split into its content (forwarded as
  a normal chunk when it says anything) and a standard usage chunk with ``choices: []``.
* ``\\r\\n`` line endings (TabbyAPI) become ``\\n``; comment pings pass through.

Parsing every event costs about a microsecond per event with orjson, next to the tens of microseconds the
ASGI server spends sending it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from gateway.engines.spec import ALL_QUIRKS, StreamQuirks

# an upstream that sends this much without ending an event is not speaking SSE
MAX_PENDING_BYTES = 1 << 20


class InvalidStream(Exception):
    """The upstream's stream is not well-formed SSE carrying JSON."""


# a key whose non-empty string value is generated output: text, reasoning, or a tool call's arguments;
# JSON allows whitespace around the colon (Python servers write ``"content": "``)
_GENERATED = re.compile(rb'"(?:content|text|reasoning_content|reasoning|arguments)"\s*:\s*"(?!")')


def text_events_in(block: bytes) -> int:
    """How many events of a (validated) SSE block carry generated output (a non-empty ``content``, ``text``,
    ``reasoning_content``/``reasoning`` or tool-call ``arguments`` string).

    A regex over the bytes, no parsing (as cheap as counting, ~0.4 us a block): inside a JSON string a quote
    is escaped, so the pattern only ever matches a key. Role-only chunks (``"content":null``), empty finish
    chunks and usage chunks do not count.
    """
    return len(_GENERATED.findall(block))


def _has_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(v not in (None, "", []) for k, v in delta.items() if k != "role")


def _payload(event: bytes) -> bytes:
    """The data of one event (its ``data:`` lines joined); InvalidStream when a line is not SSE."""
    if b"\n" not in event:
        if event.startswith(b"data:"):
            return event[5:].strip()
        raise InvalidStream(f"not an SSE data event: {event[:80]!r}")
    data = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            data.append(line[5:].strip())
        elif not line.startswith((b":", b"event:", b"id:", b"retry:")):
            raise InvalidStream(f"not an SSE line: {line[:80]!r}")
    if not data:
        raise InvalidStream("an SSE event without data")
    return b"\n".join(data)


class SSERelay:
    """Feed it upstream bytes; it returns what to send to the client (possibly ``b""``)."""

    __slots__ = ("_buf", "_crlf", "_redact", "_split_usage", "done", "error", "events", "keep_usage", "timings",
                 "usage")

    def __init__(self, keep_usage: bool, redact: Callable[[str], str] | None = None,
                 quirks: StreamQuirks = ALL_QUIRKS) -> None:
        self.keep_usage = keep_usage
        self._crlf = quirks.crlf
        self._split_usage = quirks.usage_with_choices
        self._redact = redact  # applied to the upstream's error events (they may name its address or key)
        self._buf = b""
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.error: str | None = None  # message of an error event the upstream sent mid-stream
        self.done = False  # saw data: [DONE]
        self.events = 0  # data events seen (comments are not counted)

    def feed(self, data: bytes) -> bytes:
        buf = self._buf + data if self._buf else data
        if self._crlf and b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        end = buf.rfind(b"\n\n")
        if end < 0:
            if len(buf) > MAX_PENDING_BYTES:
                raise InvalidStream(f"{len(buf)} bytes without the end of an SSE event")
            self._buf = buf
            return b""
        block, self._buf = buf[: end + 2], buf[end + 2 :]
        return self._relay(block)

    def flush(self) -> bytes:
        """What the upstream left without a closing blank line, checked like any event."""
        rest, self._buf = self._buf.strip(), b""
        return self._relay(rest + b"\n\n") if rest else b""

    def _relay(self, block: bytes) -> bytes:
        out: list[bytes] = []
        changed = False
        for event in block.split(b"\n\n"):
            if not event:
                continue
            if event.startswith(b":"):
                out.append(event)
                continue
            self.events += 1
            payload = _payload(event)
            if payload == b"[DONE]":
                self.done = True
                out.append(event)
                continue
            try:
                doc = orjson.loads(payload)
            except orjson.JSONDecodeError:
                raise InvalidStream(f"an event that is not JSON: {payload[:80]!r}") from None
            if not isinstance(doc, dict):
                raise InvalidStream(f"an event that is not a JSON object: {payload[:80]!r}")
            if "error" in doc and "choices" not in doc:
                err = doc["error"]
                self.error = str(err.get("message") if isinstance(err, dict) else err)
                if self._redact is not None:
                    scrubbed = self._redact(payload.decode("utf-8", "replace"))
                    if scrubbed.encode() != payload:
                        out.append(b"data: " + scrubbed.encode())
                        changed = True
                        continue
            timings = doc.get("timings")
            if isinstance(timings, dict):
                self.timings = timings
            usage = doc.get("usage")
            if not isinstance(usage, dict):
                out.append(event)
                continue
            self.usage = usage
            changed = True
            choices = doc.get("choices")
            if not choices:
                if self.keep_usage:
                    out.append(event)
                continue
            if not self._split_usage:  # not this engine's habit: an ordinary chunk that also says usage
                out.append(event)
                continue
            # a usage chunk that also carries choices: split it
            content = {k: v for k, v in doc.items() if k != "usage"}
            if any(_has_content(c) for c in choices):
                out.append(b"data: " + orjson.dumps(content))
            if self.keep_usage:
                out.append(b"data: " + orjson.dumps({**content, "choices": [], "usage": usage}))
        if not changed and block.endswith(b"\n\n") and len(out) == block.count(b"\n\n"):
            return block  # every event passed unchanged: forward the bytes as they came
        return b"".join(e + b"\n\n" for e in out)
