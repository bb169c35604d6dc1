"""The file watch's settling: a file being rewritten is handed on only once it held still, and only as read."""

from __future__ import annotations

import asyncio

from gateway.config_reload import stable_contents

OLD, FULL = b"auth: {keys: [...]}\nbackends: [...]\n", b"auth: {keys: [...]}\nbackends: [..., ...]\n"


class Exhausted(Exception):
    pass


def contents_handed_on(reads: list[bytes | None], every: float = 0.1, settle: float = 0.3) -> list[bytes]:
    """What the watch hands on when successive reads of the file give ``reads`` (the first: the content in
    force); time is the sleeps' count, so no test waits."""
    script = iter(reads)
    slept: list[float] = []

    async def read() -> bytes | None:
        try:
            return next(script)
        except StopIteration:
            raise Exhausted from None

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async def run() -> list[bytes]:
        out: list[bytes] = []
        try:
            async for content in stable_contents(read, every, settle, sleep=sleep):
                out.append(content)
        except Exhausted:
            pass
        assert set(slept) == {every}
        return out

    return asyncio.run(run())


def test_a_file_written_in_pieces_is_handed_on_once_whole() -> None:
    # read every 0.1 s, settle 0.3 s: a content must be read four times in a row (three agreeing reads after the
    # first, 0.3 s apart at least) before it is handed on
    empty, part, more = b"", FULL[:12], FULL[:30]
    reads = [OLD, empty, empty, empty, part, part, more, more, more, FULL, FULL, FULL]
    assert contents_handed_on(reads) == [], "FULL has held still for 0.2 s only"
    assert contents_handed_on([*reads, FULL]) == [FULL]
    assert contents_handed_on([*reads, FULL, FULL, FULL, FULL]) == [FULL], "handed on once, not at every read"


def test_a_content_that_goes_back_or_cannot_be_read_is_no_change() -> None:
    assert contents_handed_on([OLD, b"", b"", OLD, OLD, OLD, OLD, OLD]) == []
    assert contents_handed_on([OLD, FULL, FULL, None, FULL, FULL, FULL]) == [], "an unreadable moment restarts"
    assert contents_handed_on([OLD, FULL, FULL, None, FULL, FULL, FULL, FULL]) == [FULL]
    assert contents_handed_on([OLD, FULL, FULL, FULL, FULL, OLD, OLD, OLD, OLD]) == [FULL, OLD]


def test_a_settle_shorter_than_the_poll_still_needs_two_reads() -> None:
    assert contents_handed_on([OLD, FULL], every=1.0, settle=0.1) == []
    assert contents_handed_on([OLD, FULL, FULL], every=1.0, settle=0.1) == [FULL]
