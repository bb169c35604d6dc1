"""Redis answering what its scripts never return (a proxy, or a server that is not Redis) is Redis failing: the
admission raises StateUnavailable (``state.on_failure`` decides, as for an unreachable Redis), the state goes down
until a heartbeat writes the counts afresh, and nothing of the answer is believed. Sweep 19: any status but the
refusals admitted every request of a key configured to fail closed, and one answer leasing a million requests
gave a 5 requests/min key 229 answers in a minute."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.state import Budget, SharedState, Slotted, StateUnavailable, replies
from tests import waiting
from tests.state.conftest import RedisServer
from tests.state.test_shared import replicas, stop

GARBAGE = [b"OK", None, 5, True, 3.5, {}, [], [5, 0], [-1, 0], [0], [1, "100"], [True, 0], [0, 0, 0, 0],
           [0, 7, 0, 0, 0], [0, 0, 1_000_000, 0, 0], [0, 0, 0, 10**12, 0], [0, 0, -3, 0, 0], [0, 0, 0, 0, 9],
           [1, -5], [2, 0, 0, 0, 0]]


@pytest.mark.unit
@pytest.mark.parametrize("reply", GARBAGE, ids=repr)
def test_an_admission_answer_is_believed_only_within_what_was_asked(reply: Any) -> None:
    with pytest.raises(replies.BadReply):
        replies.admitted(reply, candidates=2, requests=16, tokens=1600, kept=2)


@pytest.mark.unit
def test_the_answers_the_scripts_give_are_read_as_they_are() -> None:
    assert replies.admitted([0, 1, 16, 1600, 2], 2, 16, 1600, 2) == (0, 1, 16, 1600, 2)
    assert replies.admitted([0, 0, 0, 0, 0], 0, 16, 0, 0) == (0, 0, 0, 0, 0)  # (no candidate with a slot)
    assert replies.admitted([1, 6000], 2, 16, 0, 0) == (1, 6000, 0, 0, 0)
    assert replies.admitted([3, 0], 2, 16, 0, 0)[0] == 3
    assert replies.leased([16, 0], 16, 0) == (16, 0)
    assert replies.acquired(1) is True and replies.acquired(0) is False
    for reply in ([17, 0], [0, 1601], [-1, 0], [0], b"OK"):
        with pytest.raises(replies.BadReply):
            replies.leased(reply, 16, 1600)
    for reply in (2, -1, True, b"1", None):
        with pytest.raises(replies.BadReply):
            replies.acquired(reply)


@pytest.fixture
async def state(redis_server: RedisServer) -> AsyncIterator[SharedState]:
    (one,) = await replicas(redis_server, 1, {"b"})
    yield one
    await stop([one])


@pytest.mark.system
@pytest.mark.anyio
@pytest.mark.parametrize("reply", [[0, 0, 1_000_000, 0, 0], [5, 0], b"OK", None], ids=repr)
async def test_a_garbage_admission_answer_fails_the_admission_and_leases_nothing(
        state: SharedState, reply: Any) -> None:
    budget = Budget("k", 5, None)
    run = state._script

    async def garbage(name: str, *args: Any, **kwargs: Any) -> Any:
        return reply if name == "admit" else await run(name, *args, **kwargs)

    state._script = garbage  # type: ignore[method-assign]
    with pytest.raises(StateUnavailable):
        await state.admit(budget, 0, [Slotted("x", None)])
    assert not state.up and not state._leases
    state._script = run  # type: ignore[method-assign]
    await waiting.until(lambda: state.up, "a heartbeat brought the state back")
    results = [await state.admit(budget, 0, [Slotted("x", None)]) for _ in range(7)]
    assert [r.limited for r in results] == [None] * 5 + ["requests"] * 2, "the key's minute, exactly"
