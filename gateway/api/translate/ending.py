"""What the two translated streams (Messages, Responses) share: ending with their API's failure event."""

from __future__ import annotations


class Ending:
    """``abort``: the stream's failure event now, whatever it holds (an engine's event it could not read: the rest
    of it is dropped); b"" once closed. The stream says what its failure event is (``_fail``)."""

    _closed: bool
    _pending: bytes

    def _fail(self, out: list[bytes], message: str) -> None:
        raise NotImplementedError

    def abort(self, message: str) -> bytes:
        if self._closed:
            return b""
        self._pending = b""
        out: list[bytes] = []
        self._fail(out, message)
        return b"".join(out)
