"""Redis's answers to the admission scripts (:mod:`gateway.state.scripts`), checked before they are believed.

An answer that is not one the script returns (a proxy, or a server that is not Redis, answering garbage) is Redis
failing: :class:`BadReply`, handled as an unreachable Redis (``state.on_failure`` applies), never read as an
admission or a lease. Unchecked, any status but the refusals admitted a request of a key configured to fail
closed, and one reply leasing a million requests lifted a key's limit for as long as the lease lasted (229
answers in a minute to a 5 requests/min key: sweep 19).
"""

from __future__ import annotations

from typing import Any

from gateway.state.errors import StateUnavailable

MAX_RETRY_MS = 10**15  # what the scripts' wait() caps a retry-after at


class BadReply(StateUnavailable):
    """Redis answered something its script never returns."""


def _int(value: Any, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise BadReply(f"Redis answered {what} {value!r}, not an integer in [{low}, {high}]")
    return value


def _array(reply: Any, lengths: tuple[int, ...], script: str) -> list[Any]:
    if not isinstance(reply, list) or len(reply) not in lengths:
        raise BadReply(f"Redis answered the {script} script with {type(reply).__name__} {str(reply)[:80]!r}")
    return reply


def admitted(reply: Any, candidates: int, requests: int, tokens: int, kept: int) -> tuple[int, int, int, int, int]:
    """ADMIT's answer as (status, index or retry-after ms, requests leased, tokens leased, slots kept), each
    within what was asked: ``candidates`` sent, at most ``requests`` and ``tokens`` leased, ``kept`` slots."""
    reply = _array(reply, (2, 5), "admission")
    status = _int(reply[0], 0, 4, "an admission's status")
    if status != 0:
        if len(reply) != 2:
            raise BadReply(f"Redis answered a refusal with {len(reply)} figures")
        return status, _int(reply[1], 0, MAX_RETRY_MS, "a retry-after"), 0, 0, 0
    if len(reply) != 5:
        raise BadReply("Redis answered an admission with 2 figures")
    return (0, _int(reply[1], 0, max(0, candidates - 1), "an admission's backend"),
            _int(reply[2], 0, requests, "requests leased"), _int(reply[3], 0, tokens, "tokens leased"),
            _int(reply[4], 0, kept, "slots kept"))


def leased(reply: Any, requests: int, tokens: int) -> tuple[int, int]:
    """LEASE's answer: (requests leased, tokens leased), at most ``requests`` and ``tokens``."""
    reply = _array(reply, (2,), "lease")
    return _int(reply[0], 0, requests, "requests leased"), _int(reply[1], 0, tokens, "tokens leased")


def acquired(reply: Any) -> bool:
    """ACQUIRE's answer: whether the slot was taken."""
    return bool(_int(reply, 0, 1, "a slot taken"))
