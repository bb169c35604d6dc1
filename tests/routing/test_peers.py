"""What routing tells the other gateway replicas and takes from them (with shared state): sessions and the
prompt blocks routed to each backend, through the Peers seam; alone, nothing is published."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.config import settings_from_mapping
from gateway.routing.policies import build_pipeline
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState
from tests.routing.helpers import backend

pytestmark = pytest.mark.unit


class Wire:
    """Two replicas' peers joined directly: what one publishes the other's handlers get."""

    def __init__(self) -> None:
        self.handlers: dict[int, dict[str, list[Callable[[Any], None]]]] = {0: {}, 1: {}}
        self.sent: list[tuple[int, str, Any]] = []

    def peer(self, me: int) -> Any:
        wire = self

        class Peer:
            def publish(self, topic: str, payload: Any) -> None:
                wire.sent.append((me, topic, payload))
                for handler in wire.handlers[1 - me].get(topic, ()):
                    handler(payload)

            def subscribe(self, topic: str, handler: Callable[[Any], None]) -> None:
                wire.handlers[me].setdefault(topic, []).append(handler)

        return Peer()


def replica(wire: Wire, me: int) -> Any:
    state = RoutingState()
    state.peers = wire.peer(me)
    return build_pipeline(settings_from_mapping({"routing": {"policy": "default"}}).routing, state), state


def chat(system: str, question: str, session: str | None = None) -> RouteRequest:
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    return RouteRequest(route="chat", model="m", stream=False, max_tokens=8, body=body, session_key=session)


def test_a_session_routed_on_one_replica_sticks_on_the_other() -> None:
    wire = Wire()
    (one, _), (two, _) = replica(wire, 0), replica(wire, 1)
    backends = [backend(n, slots=8) for n in "abc"]
    first = one.route(chat("s", "hello", session="conv-1"), backends).ranked[0]
    one.routed(chat("s", "hello", session="conv-1"), first)
    for i in range(5):
        decision = two.route(chat("s", f"turn {i}", session="conv-1"), backends)
        assert decision.ranked[0] is first and decision.reason == "session"
        two.routed(chat("s", f"turn {i}", session="conv-1"), first)
    sessions = [p[:3] for _, topic, p in wire.sent if topic == "session"]
    assert sessions == [("conv-1", first.name, 1)], "told once: new; the same backend again is not news"


def test_every_replica_places_a_new_session_alike_before_hearing_of_it() -> None:
    wire = Wire()
    (one, _), (two, _) = replica(Wire(), 0), replica(wire, 1)  # (one's messages never reach two)
    backends = [backend(n, slots=8) for n in "abcd"]
    for i in range(20):
        session = f"conv-{i}"
        assert (one.route(chat("s", "hi", session=session), backends).ranked[0]
                is two.route(chat("s", "hi", session=session), backends).ranked[0])


def test_replicas_that_placed_a_session_apart_agree_on_the_earlier_placement() -> None:
    from gateway.routing.scorers.session import SessionTable

    one, two = SessionTable(), SessionTable()
    assert one.put("conv", "a") and two.put("conv", "b")  # placed apart, each before hearing of the other
    told_one, told_two = one.stamp("conv"), two.stamp("conv")
    assert told_one is not None and told_two is not None
    one.merge("conv", "b", *told_two)  # the messages cross
    two.merge("conv", "a", *told_one)
    assert one.get("conv") == two.get("conv") == "a"  # the earlier placement, on both
    assert one.put("conv", "c")  # a move (its backend overloaded) is news and wins over the first placement
    two.merge("conv", "c", *one.stamp("conv"))  # type: ignore[misc]
    assert two.get("conv") == "c"
    two.merge("conv", "a", *told_one)  # a late copy of the first placement changes nothing
    assert two.get("conv") == "c"


def test_blocks_routed_by_one_replica_are_in_the_others_index() -> None:
    wire = Wire()
    (one, _), (_, two_state) = replica(wire, 0), replica(wire, 1)
    backends = [backend(n, slots=8) for n in "ab"]
    system = "a long shared system prompt " * 20
    two_state.prefix.for_backend(backends[1])  # (the other replica knows the backend: it has an index for it)
    request = chat(system, "q1")
    one.routed(request, backends[1])
    assert two_state.prefix.match(backends[1], chat(system, "q2").blocks) == len(system) // 128
    blocks = [p for _, topic, p in wire.sent if topic == "blocks"]
    assert blocks == [("b", request.blocks)]


def test_a_rebuilt_pipeline_keeps_the_sessions_placements() -> None:
    state = RoutingState()
    routing = settings_from_mapping({"routing": {"policy": "default"}}).routing
    first = build_pipeline(routing, state)
    backends = [backend(n, slots=8) for n in "abc"]
    first.routed(chat("s", "hello", session="conv-9"), backends[2])
    again = build_pipeline(routing, state)  # (a reload)
    decision = again.route(chat("s", "next", session="conv-9"), backends)
    assert decision.ranked[0] is backends[2] and decision.reason == "session"
