"""The stall guard's verdicts, reading by reading (gateway.proxy.stall_guard; on a real llama-server:
tests/llamacpp/test_stall_guard.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gateway.config import StallGuardSettings
from gateway.engines.registry import create_adapter
from gateway.pool.backend import Backend
from gateway.pool.state import LoopReading
from gateway.proxy.stall_guard import (
    ALONE_EVERY,
    DROP_GRACE,
    DROP_STEPS,
    HOLD_SECONDS,
    MAX_STEP,
    MAX_STRIKE_SECONDS,
    STALL_FLOOR,
    USUAL_LEAST,
    StallGuard,
)
from gateway.routing.request import RouteRequest
from gateway.structured import extract
from tests.clock import ManualClock
from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over
from tests.waiting import wait_until

GRAMMAR = 'root ::= "a"+\n'
GRACE = DROP_GRACE + DROP_STEPS * MAX_STEP  # (past it, the engine surely let a stopped request go)


def llama(name: str = "l") -> Backend:
    return Backend(name, "llamacpp", "http://127.0.0.1:1", spec=create_adapter("llamacpp").spec)


def request(grammar: str | None = GRAMMAR, **body: Any) -> RouteRequest:
    body = {"model": "m", "prompt": "hi", **body}
    if grammar is not None:
        body["grammar"] = grammar
    return RouteRequest(route="completions", model="m", stream=False, max_tokens=8, body=body,
                        constraint=extract(body))


class Running:
    """A request in flight as the dispatcher notes it, stopped by the guard when it says."""

    def __init__(self, guard: StallGuard, backend: Backend, key: str | None, req: RouteRequest) -> None:
        self.guard = guard
        self.why: str | None = None
        watched = guard.watch(backend, req, key)
        assert watched is not None
        self.watched = watched
        watched.stop = self.stop

    def stop(self, why: str) -> bool:
        self.why = why
        return True

    def end(self) -> None:
        self.guard.ended(self.watched)


def reading(step: float, running: int | None = 1, in_flight: int | None = 1, backend: str = "l",
            prefilling: bool = False) -> LoopReading:
    return LoopReading(backend, step, running, in_flight, prefilling)


def setup(**settings: Any) -> tuple[StallGuard, ManualClock, Backend]:
    clock = ManualClock()
    guard = StallGuard(StallGuardSettings(**settings), clock, CollectorRegistry())
    return guard, clock, llama()


def stops(guard: StallGuard, verdict: str) -> float:
    return guard.stops.labels("l", verdict)._value.get()


def test_two_slow_readings_stop_the_longest_running_and_a_prompt_loop_after_convicts_it() -> None:
    guard, clock, backend = setup()
    first = Running(guard, backend, "a", request())
    clock.advance(1)
    second = Running(guard, backend, "b", request(GRAMMAR + "# b\n"))
    guard.ended(second.watched, finished=True)  # (its answer came whole before the stall: not a suspect)
    guard.reading(reading(2.0, running=1, in_flight=1))
    assert first.why is None, "one slow reading is no stall"
    guard.reading(reading(0.1, running=1, in_flight=1))
    guard.reading(reading(0.1, running=1, in_flight=1))
    guard.reading(reading(2.0, running=1, in_flight=1))
    assert first.why is None, "two slow among the last three readings, not in all"
    guard.reading(reading(0.5, running=1, in_flight=1))  # (a reading waits what is left of a step: any of it)
    guard.reading(reading(2.0, running=1, in_flight=1))
    assert first.why is not None and "slowed to 2.0 s" in first.why
    first.end()
    guard.reading(reading(2.0, running=1, in_flight=0))  # (the engine has not let it go yet: no verdict)
    assert stops(guard, "cause") == 0 and stops(guard, "not_cause") == 0
    clock.advance(GRACE)  # (the engine surely let it go)
    guard.reading(reading(0.05, running=0, in_flight=0))
    assert stops(guard, "cause") == 1
    # its key's requests with a grammar kept; another key's not, nor the same grammar from another key (a false
    # verdict would bar a common grammar from every key; one tenant holds one key)
    kept = guard.kept(request(GRAMMAR + "# other\n"), "a")
    assert kept is not None and "this key" in kept[0] and kept[1] == 600
    assert guard.kept(request(), "b") is None
    assert guard.kept(request(GRAMMAR + "# b\n"), "b") is None
    assert guard.kept(request(None), "a") is None, "a request without a grammar is not kept"
    clock.advance(601)
    assert guard.kept(request(), "a") is None, "kept for strike_seconds"


def test_a_stopped_request_that_was_not_the_cause_is_acquitted_and_the_next_stopped() -> None:
    guard, clock, backend = setup()
    first = Running(guard, backend, "innocent", request(GRAMMAR + "# i\n"))
    clock.advance(1)
    second = Running(guard, backend, "guilty", request())
    guard.reading(reading(3.0, running=2, in_flight=2))
    guard.reading(reading(3.0, running=2, in_flight=2))
    assert first.why is not None and second.why is None
    first.end()
    # the engine lets it go within a second and three of its steps: till then, no verdict
    guard.reading(reading(2.0, running=None, in_flight=1))
    clock.advance(GRACE)
    guard.reading(reading(3.0, running=1, in_flight=1))
    assert second.why is None
    guard.reading(reading(3.0, running=1, in_flight=1))
    assert stops(guard, "not_cause") == 1 and second.why is not None, "acquitted, and the next stopped at once"
    second.end()
    clock.advance(GRACE)  # (the engine surely let it go)
    guard.reading(reading(0.01, running=1, in_flight=1))
    assert stops(guard, "cause") == 1
    assert guard.kept(request(GRAMMAR + "# x\n"), "innocent") is None
    assert guard.kept(request(GRAMMAR + "# x\n"), "guilty") is not None


def test_the_engine_is_taken_to_let_a_stopped_request_go_within_four_steps() -> None:
    """A worker that takes another's readings knows no in-flight count, and other processes' requests are in the
    engine's: waiting for counts, each decoy stopped first bought the real staller 60 s (sweep 29). The engine
    looks for a gone client about once a second and lets it go between two steps."""
    guard, clock, backend = setup()
    first = Running(guard, backend, "decoy", request())
    clock.advance(1)
    second = Running(guard, backend, "b", request(GRAMMAR + "# b\n"))
    guard.reading(reading(2.0, running=None, in_flight=None))
    guard.reading(reading(2.0, running=None, in_flight=None))
    assert first.why is not None
    first.end()
    for _ in range(4):  # (within 1.5 s and four of its 2 s steps: maybe not let go yet)
        clock.advance(2)
        guard.reading(reading(2.0, running=3, in_flight=None))
    assert second.why is None
    for _ in range(3):
        clock.advance(1)
        guard.reading(reading(2.0, running=3, in_flight=None))
    assert second.why is not None and stops(guard, "not_cause") == 1, "acquitted ~11 s after it ended, not 60"
    second.end()


def test_each_repeat_doubles_the_time_a_key_is_kept_up_to_a_day() -> None:
    guard, clock, backend = setup(strike_seconds=100)
    kept_for = []
    for n in range(12):
        running = Running(guard, backend, "a", request(GRAMMAR + f"# {n}\n"))
        guard.reading(reading(2.0))
        guard.reading(reading(2.0))
        running.end()
        clock.advance(GRACE)  # (the engine surely let it go)
        guard.reading(reading(0.01))
        kept = guard.kept(request(GRAMMAR + "# another\n"), "a")
        assert kept is not None
        kept_for.append(kept[1])
        clock.advance(kept[1] + 1)
    assert kept_for[:4] == [100, 200, 400, 800] and kept_for[-1] == MAX_STRIKE_SECONDS, kept_for


def test_without_keys_the_grammar_alone_is_kept() -> None:
    guard, clock, backend = setup()
    running = Running(guard, backend, None, request())
    guard.reading(reading(2.0))
    guard.reading(reading(2.0))
    running.end()
    clock.advance(GRACE)  # (the engine surely let it go)
    guard.reading(reading(0.0))
    assert guard.kept(request(), None) is not None
    assert guard.kept(request(GRAMMAR + "# other\n"), None) is None


def test_the_guard_watches_only_requests_with_a_grammar_on_engines_with_one_loop() -> None:
    guard, _clock, backend = setup()
    assert guard.watch(backend, request(None), "a") is None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert guard.watch(backend, request(None, tools=tools), "a") is not None
    assert guard.watch(backend, request(None, tools=tools, tool_choice="none"), "a") is None
    vllm = Backend("v", "vllm", "http://127.0.0.1:2", spec=create_adapter("vllm").spec)
    assert guard.watch(vllm, request(), "a") is None
    off, _, _ = setup(enabled=False)
    assert off.watch(backend, request(), "a") is None


def test_a_slow_loop_with_no_request_with_a_grammar_there_stops_nothing() -> None:
    guard, _clock, backend = setup()
    for _ in range(5):
        guard.reading(reading(10.0))
    running = Running(guard, backend, "a", request())
    guard.reading(reading(0.5))
    guard.reading(reading(0.9))
    assert running.why is None, "below stall_seconds"
    guard.reading(reading(2.0, backend="other"))
    guard.reading(reading(2.0, backend="other"))
    assert running.why is None, "another backend's loop"


def test_the_loop_is_read_as_the_load_readings_wait_less_the_health_checks() -> None:
    """llama.cpp answers /health on its HTTP thread and /metrics between two steps of its loop: what the reading
    waits beyond the health check is the loop's; a slow network or gateway slows both and is not counted."""
    with ScriptedUpstream(model="m") as upstream:
        upstream.get_answers["/health"] = (200, b'{"status": "ok"}')
        upstream.get_answers["/slots"] = (200, b'[{"id": 0, "is_processing": true}, {"id": 1, "is_processing": true}]')
        upstream.get_answers["/metrics"] = (200, b"llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n")
        upstream.get_delays["/metrics"] = 0.3
        app, server = gateway_over(upstream, backend={"engine": "llamacpp"})
        readings: list[LoopReading] = []
        app.gateway.pool.on_loop = readings.append
        with server:
            wait_until(lambda: len(readings) >= 2, "two readings of the loop")
            assert 0.25 < readings[-1].step < 1.0 and readings[-1].running == 3, readings[-1]
            upstream.get_delays["/health"] = 0.3
            seen = len(readings)
            wait_until(lambda: len(readings) >= seen + 2, "two more readings")
            assert readings[-1].step < 0.2, readings[-1]
            upstream.get_delays["/metrics"] = 2.0  # (past the scrape's timeout of 1 s: a reading that did not come)
            seen = len(readings)
            wait_until(lambda: len(readings) >= seen + 2, "two more readings", within=20)
            assert readings[-1].running is None and 0.5 < readings[-1].step <= 1.0, readings[-1]


def test_a_stall_is_also_many_times_the_loops_usual_and_a_prompt_being_read_is_held_to_stall_seconds() -> None:
    guard, clock, backend = setup(stall_seconds=1.0, stall_factor=8)
    assert guard.stall("l") == 1.0, "with no usual yet, stall_seconds"
    for n in range(USUAL_LEAST):
        guard.reading(reading(0.002 + n * 0.0002))
    assert guard.stall("l") == STALL_FLOOR, "8x a usual of ~5 ms is below the floor"
    for _ in range(USUAL_LEAST * 4):
        guard.reading(reading(0.05))
    assert guard.stall("l") == 0.4
    running = Running(guard, backend, "a", request())
    for _ in range(4):  # (a prompt being read: steps as long as a batch of it, held to stall_seconds alone)
        guard.reading(reading(0.9, running=1, in_flight=1, prefilling=True))
    assert running.why is None and guard.stall("l") == 0.4, "no part of the usual either"
    guard.reading(reading(0.5, running=1, in_flight=1))  # (the step that ended the prompt: held so too)
    guard.reading(reading(0.5, running=1, in_flight=1))
    assert running.why is None
    guard.reading(reading(0.5, running=1, in_flight=1))
    assert running.why is not None and "slowed to 0.5 s" in running.why
    running.end()
    clock.advance(GRACE)  # (the engine surely let it go)
    guard.reading(reading(0.05, running=1, in_flight=1))
    assert guard.kept(request(), "a") is not None
    # a key's long prompts do not hide its grammar's stall past stall_seconds, once a step without a prompt shows it
    masked = Running(guard, backend, "b", request(GRAMMAR + "# b\n"))
    guard.reading(reading(1.5, running=2, in_flight=2, prefilling=True))
    guard.reading(reading(1.5, running=2, in_flight=2, prefilling=True))
    assert masked.why is None, "prompts read, slow by nature"
    guard.reading(reading(1.5, running=2, in_flight=2))  # (the step that ended the prompt)
    assert masked.why is None
    guard.reading(reading(1.5, running=2, in_flight=2))
    assert masked.why is not None


@pytest.mark.anyio
async def test_llamacpp_slots_reading_a_prompt_are_told_apart() -> None:
    slots = [{"id": 0, "is_processing": True, "next_token": [{"n_decoded": 5}]},
             {"id": 1, "is_processing": False, "next_token": [{"n_decoded": 0}]}]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/slots":
            return httpx.Response(200, json=slots)
        return httpx.Response(200, text="llamacpp:requests_deferred 0\n")

    adapter = create_adapter("llamacpp")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://l") as client:
        load = await adapter.read_load(client)
        assert load is not None and load.running == 1 and not load.prefilling
        slots.append({"id": 2, "is_processing": True, "next_token": [{"n_decoded": 0}]})
        load = await adapter.read_load(client)
        assert load is not None and load.running == 2 and load.prefilling


def test_this_processs_own_lateness_is_taken_off_each_reading() -> None:
    """A gateway whose own event loop lags measures every reading that much longer: that is not the engine's."""
    clock = ManualClock()
    late = [1.5]
    guard = StallGuard(StallGuardSettings(), clock, CollectorRegistry(), lateness=lambda seconds: late[0])
    running = Running(guard, llama(), "a", request())
    guard.reading(reading(2.0, running=1, in_flight=1))
    guard.reading(reading(2.0, running=1, in_flight=1))
    assert running.why is None, "0.5 s of the engine's, under the 1 s threshold"
    late[0] = 0.0
    guard.reading(reading(2.0, running=1, in_flight=1))
    guard.reading(reading(2.0, running=1, in_flight=1))
    assert running.why is not None


def stall_and_stop(guard: StallGuard) -> None:
    guard.reading(reading(3.0, running=2, in_flight=2))
    guard.reading(reading(3.0, running=2, in_flight=2))


def test_a_key_cannot_get_anothers_request_convicted_by_ending_its_own_stalling_one() -> None:
    """Sweeps 29-30: the victim's long request was the one stopped; the attacker's, which stalled the loop, ended
    (or turned cheap) at that moment, and the victim was convicted. One begun since the loop was last read fine is
    stopped first; where the recovery may owe to another key's request that ended, or that runs there still (its
    pace may have changed), no one is struck, and a key whose request ended so is stopped first next time."""
    guard, clock, backend = setup()
    victim = Running(guard, backend, "victim", request(GRAMMAR + "# victim\n"))
    clock.advance(5)
    guard.reading(reading(0.01, running=1, in_flight=1))  # (the loop fine with the victim's)
    clock.advance(1)
    attacker = Running(guard, backend, "attacker", request(GRAMMAR + "# 1\n"))
    stall_and_stop(guard)
    assert attacker.why is not None and victim.why is None, "the one begun since the loop was fine"
    attacker.end()
    clock.advance(GRACE)
    guard.reading(reading(0.01, running=1, in_flight=1))
    assert stops(guard, "unresolved") == 1 and stops(guard, "cause") == 0, "the victim's runs on beside it"
    assert guard.kept(request(GRAMMAR + "# victim\n"), "victim") is None
    # where the victim's was stopped (begun together) and the attacker's ended as it was: unresolved, and the
    # attacker's stopped first at the next stall
    clock.advance(60)
    attacker = Running(guard, backend, "attacker", request(GRAMMAR + "# 2\n"))
    stall_and_stop(guard)
    assert attacker.why is not None and victim.why is None
    victim.end()
    attacker.end()
    clock.advance(GRACE)
    guard.reading(reading(0.01, running=0, in_flight=0))
    assert stops(guard, "unresolved") == 2 and guard.kept(request(GRAMMAR + "# v\n"), "victim") is None
    clock.advance(60)
    victim = Running(guard, backend, "victim", request(GRAMMAR + "# victim\n"))
    attacker = Running(guard, backend, "attacker", request(GRAMMAR + "# 3\n"))
    guard.ended(victim.watched, finished=True)
    stall_and_stop(guard)
    assert attacker.why is not None
    attacker.end()
    clock.advance(GRACE)
    guard.reading(reading(0.01, running=0, in_flight=0))
    assert stops(guard, "cause") == 1, "alone there: convicted"
    assert guard.kept(request(GRAMMAR + "# other\n"), "attacker") is not None
    assert guard.kept(request(GRAMMAR + "# victim\n"), "victim") is None


def test_a_key_whose_requests_only_ended_during_others_stalls_is_never_struck() -> None:
    """Sweep 30: a tenant's short requests with a grammar ending while another key's stalled the loop made it a
    suspect of each stall, and three stalls struck it with the staller. Only a request stopped can count one."""
    guard, clock, backend = setup()
    for n in range(6):
        staller = Running(guard, backend, "attacker", request(GRAMMAR + f"# {n}\n"))
        clock.advance(1)
        stall_and_stop(guard)
        assert staller.why is not None
        bystander = Running(guard, backend, "bystander", request(GRAMMAR + "# json\n"))
        bystander.end()  # (its short answer done while the loop was slow)
        staller.end()
        clock.advance(GRACE)
        guard.reading(reading(0.01, running=1, in_flight=1))
        clock.advance(30)
    assert guard.kept(request(GRAMMAR + "# json\n"), "bystander") is None
    assert stops(guard, "cause") == 0 and stops(guard, "unresolved") == 6


def test_a_key_whose_other_request_ends_as_its_stalling_one_is_stopped_is_struck_all_the_same() -> None:
    guard, clock, backend = setup()
    first = Running(guard, backend, "a", request(GRAMMAR + "# 1\n"))
    clock.advance(1)
    second = Running(guard, backend, "a", request(GRAMMAR + "# 2\n"))
    stall_and_stop(guard)
    first.end()
    second.end()
    clock.advance(GRACE)  # (the engine surely let it go)
    guard.reading(reading(0.01, running=1, in_flight=1))
    assert stops(guard, "cause") == 1
    assert guard.kept(request(GRAMMAR + "# 3\n"), "a") is not None
    assert guard.kept(request(GRAMMAR + "# 1\n"), "b") is None


def test_an_honest_slow_engine_is_not_judged_by_its_idle_loop() -> None:
    """Sweep 29: the usual was learnt from idle readings (~0 ms), so an engine whose steps take 0.3 s had the first
    grammar that ran alone stopped at the 0.1 s floor, and convicted by the idle loop after it. Only readings of a
    loop at work for requests without a grammar make its usual."""
    guard, _clock, backend = setup()
    for _ in range(USUAL_LEAST * 2):  # idle
        guard.reading(reading(0.0, running=0, in_flight=0))
    assert guard.stall("l") == 1.0, "no usual from an idle loop"
    alone = Running(guard, backend, "a", request())
    for _ in range(5):
        guard.reading(reading(0.3, running=1, in_flight=1))
    assert alone.why is None
    alone.end()
    for _ in range(USUAL_LEAST):  # busy with plain requests at its pace
        guard.reading(reading(0.3, running=2, in_flight=2))
    assert guard.stall("l") == 1.0, "8x 0.3 s, bounded by stall_seconds"
    # nor do grammars below the threshold raise it (run long, sweep 29's ramp took it from 0.1 to 0.91 s)
    guard2, _clock2, _backend2 = setup()
    for _ in range(USUAL_LEAST):
        guard2.reading(reading(0.01, running=1, in_flight=1))
    ramp = Running(guard2, backend, "a", request())
    for _ in range(USUAL_LEAST * 4):
        guard2.reading(reading(0.09, running=2, in_flight=2))
    assert guard2.stall("l") == STALL_FLOOR and ramp.why is None
    ramp.end()


def test_where_the_engine_runs_what_this_process_did_not_send_no_one_is_struck() -> None:
    """Sweeps 29-30, with server.workers 2 or replicas: each process's guard sees its own requests only; one
    holding the victim's stopped it, and the attacker's ending on the other made the loop recover: the victim was
    struck (at once, then at the third such stall). Where the engine ran anything this process did not send it at
    any reading of the stall, no one is struck for it, however often."""
    guard, clock, backend = setup()
    for n in range(6):
        victim = Running(guard, backend, "victim", request())
        guard.reading(reading(2.0, running=2, in_flight=1))
        guard.reading(reading(2.0, running=2, in_flight=1))
        assert victim.why is not None
        victim.end()
        clock.advance(GRACE)  # (the engine surely let it go, and the other process's request is gone too)
        guard.reading(reading(0.01, running=0, in_flight=0))
        assert guard.kept(request(), "victim") is None, n
        clock.advance(60)
    assert stops(guard, "unresolved") == 6 and stops(guard, "cause") == 0
    # alone there, the same stall strikes
    alone = Running(guard, backend, "victim", request())
    guard.reading(reading(2.0, running=1, in_flight=1))
    guard.reading(reading(2.0, running=1, in_flight=1))
    alone.end()
    clock.advance(GRACE)
    guard.reading(reading(0.01, running=0, in_flight=0))
    assert guard.kept(request(), "victim") is not None

def test_a_key_that_sends_the_next_as_each_is_stopped_is_struck() -> None:
    """Sweep 29: a key resending its stalling request as each got its 503 was acquitted three times (the loop
    still slow: its next request) before it was struck. Still slow with only its key's requests with a grammar
    left there, the stall is that key's either way."""
    guard, clock, backend = setup()
    first = Running(guard, backend, "a", request())
    guard.reading(reading(2.0))
    guard.reading(reading(2.0))
    assert first.why is not None
    first.end()
    second = Running(guard, backend, "a", request())  # (sent as the first's 503 came)
    for _ in range(6):
        clock.advance(2)
        guard.reading(reading(2.0))
    assert guard.kept(request(GRAMMAR + "# other\n"), "a") is not None and second.why is not None
    second.end()


def test_turning_the_guard_off_forgets_its_strikes() -> None:
    guard, clock, backend = setup()
    running = Running(guard, backend, "a", request())
    guard.reading(reading(2.0))
    guard.reading(reading(2.0))
    running.end()
    clock.advance(GRACE)  # (the engine surely let it go)
    guard.reading(reading(0.01))
    assert guard.kept(request(), "a") is not None
    guard.configure(StallGuardSettings(enabled=False))
    guard.configure(StallGuardSettings())
    assert guard.kept(request(), "a") is None


def test_a_stall_whose_request_ended_on_its_own_just_before_the_stop_strikes_no_one() -> None:
    """Sweep 29: a key's short stalling request ended on its own between the guard's two slow readings; the
    victim's older request was then stopped, the loop was prompt, and the victim was convicted. One that ended
    since the last reading defers the stop a reading; the stall gone with it, nothing is stopped."""
    guard, clock, backend = setup()
    victim = Running(guard, backend, "victim", request(GRAMMAR + "# v\n"))
    clock.advance(1)
    attacker = Running(guard, backend, "attacker", request())
    guard.reading(reading(2.0, running=2, in_flight=2))
    clock.advance(1)
    attacker.end()
    clock.advance(1)
    guard.reading(reading(2.0, running=1, in_flight=1))  # (taken while the attacker's still ran)
    assert victim.why is None, "deferred: the stall may have gone with the one that ended"
    clock.advance(1)
    guard.reading(reading(0.01, running=1, in_flight=1))
    assert victim.why is None and guard.kept(request(), "victim") is None
    # still slow once the engine surely let it go: the victim's stopped (a retryable 503), and with the
    # attacker's among those that ended in the stall, no one is struck for it
    attacker = Running(guard, backend, "attacker", request())
    guard.reading(reading(2.0, running=2, in_flight=2))
    clock.advance(1)
    attacker.end()
    clock.advance(1)
    guard.reading(reading(2.0, running=2, in_flight=1))
    clock.advance(1)
    guard.reading(reading(2.0, running=2, in_flight=1))
    assert victim.why is None, "the engine may run the attacker's still: its drop is waited for"
    clock.advance(DROP_GRACE + DROP_STEPS * 2.0)
    guard.reading(reading(2.0, running=1, in_flight=1))
    assert victim.why is not None
    victim.end()
    clock.advance(GRACE)  # (the engine surely let it go)
    guard.reading(reading(0.01, running=0, in_flight=0))
    assert stops(guard, "unresolved") == 1 and guard.kept(request(), "victim") is None


def test_a_stopped_request_on_steps_longer_than_a_reading_is_given_the_longest_drop() -> None:
    """Sweep 29 re-run: a resent recursive schema (each "[" four times the step before) had readings time out (a
    step longer than a reading waits); taken as 2 s steps, it was acquitted while it still held the engine."""
    guard, clock, backend = setup()
    first = Running(guard, backend, "a", request())
    second = Running(guard, backend, "b", request(GRAMMAR + "# b\n"))
    guard.reading(reading(2.0, running=None))
    guard.reading(reading(2.0, running=None))
    assert first.why is not None
    first.end()
    for _ in range(8):  # (20 s of readings that time out)
        clock.advance(2.5)
        guard.reading(reading(2.0, running=None))
    assert second.why is None, "not acquitted while the engine may still be on its step"
    for _ in range(3):
        clock.advance(2.5)
        guard.reading(reading(2.0, running=None))
    assert second.why is not None
    second.end()


def test_a_key_with_a_request_stopped_is_held_until_its_verdict() -> None:
    """Sweep 29 re-run: a key resending its stalling request as each 503 came had the next admitted before the
    strike (the verdict waits for the engine to let the first go), and it stalled the engine again."""
    guard, clock, backend = setup()
    first = Running(guard, backend, "a", request())
    guard.reading(reading(2.0))
    guard.reading(reading(2.0))
    assert first.why is not None
    first.end()
    held = guard.kept(request(GRAMMAR + "# next\n"), "a")
    assert held is not None and "until that is settled" in held[0]
    # (sweep 30: it said 40 s, and held up to 61.5)
    assert f"at most {HOLD_SECONDS:.0f} s" in held[0] and held[1] == HOLD_SECONDS
    assert guard.kept(request(), "b") is None and guard.kept(request(None), "a") is None
    clock.advance(GRACE)
    guard.reading(reading(0.01))
    kept = guard.kept(request(GRAMMAR + "# next\n"), "a")
    assert kept is not None and "until that is settled" not in kept[0], "convicted: struck"
    # an innocent one stopped is held only until it is acquitted; with no verdict at all, not for long
    other = Running(guard, backend, "b", request())
    guard.reading(reading(2.0))
    guard.reading(reading(2.0))
    other.end()
    assert guard.kept(request(), "b") is not None
    clock.advance(HOLD_SECONDS + 1)  # (no reading came: its backend gone)
    assert guard.kept(request(), "b") is None


def test_another_keys_long_prompts_stop_no_request_with_a_grammar() -> None:
    """Sweep 30: another key's plain request whose prompt took 3 s a batch to read made two slow readings; the
    victim's request with a grammar, the only one there, was stopped and, the prompt read, convicted. A step that
    read a prompt is slow by nature: a stall needs a slow step that read none (no sequence reading its prompt now
    or at the last reading, and none begun since: one batch of prompt is read in one step)."""
    guard, clock, backend = setup()
    victim = Running(guard, backend, "victim", request())
    tasks = frozenset({1})
    guard.reading(LoopReading("l", 0.01, 1, 1, False, tasks))
    for _ in range(3):  # a long prompt, read in batches of 3 s
        guard.reading(LoopReading("l", 3.0, 2, 2, True, tasks | {2}))
    guard.reading(LoopReading("l", 3.0, 2, 2, False, tasks | {2}))  # (the step that ended it)
    guard.reading(LoopReading("l", 0.01, 2, 2, False, tasks | {2}))
    for n in range(3, 9):  # prompts of one batch each, back to back: each a new sequence, read in one step
        guard.reading(LoopReading("l", 3.0, 2, 2, False, tasks | {n}))
    assert victim.why is None
    assert stops(guard, "cause") == 0 and guard.kept(request(), "victim") is None
    # a slow step that read no prompt shows a stall
    guard.reading(LoopReading("l", 3.0, 2, 2, False, tasks | {8}))
    assert victim.why is not None
    victim.end()
    clock.advance(GRACE)
    guard.reading(LoopReading("l", 0.01, 1, 1, False, frozenset({8})))


@pytest.mark.anyio
async def test_llamacpp_slots_say_the_tasks_they_run() -> None:
    adapter = create_adapter("llamacpp")

    def answer(slots: list[dict[str, Any]]) -> httpx.MockTransport:
        return httpx.MockTransport(lambda r: httpx.Response(200, json=slots) if r.url.path == "/slots"
                                   else httpx.Response(200, text="llamacpp:requests_deferred 0\n"))

    busy = {"id": 0, "id_task": 7, "is_processing": True, "next_token": [{"n_decoded": 3}]}
    idle = {"id": 1, "id_task": 5, "is_processing": False, "next_token": [{"n_decoded": 9}]}
    async with httpx.AsyncClient(transport=answer([busy, idle]), base_url="http://l") as client:
        load = await adapter.read_load(client)
    assert load is not None and load.tasks == frozenset({7}), "only the slots at work"
    async with httpx.AsyncClient(transport=answer([{**busy, "id_task": "7"}]), base_url="http://l") as client:
        load = await adapter.read_load(client)
    assert load is not None and load.tasks is None, "a task id that is not a number: unsaid"


def test_a_request_whose_client_left_before_the_stall_was_read_is_its_cause_when_the_loop_recovers_without_it() -> None:
    """Sweep 30: the attacker's client left as soon as one token took over a second, before any slow reading; the
    engine ran its request on for a step or two, the guard stopped the victim's, the only one it had, and the loop's
    recovery convicted the victim. One that ended lately without its answer may run there still: the stall waits
    for the engine to let it go, and a recovery then is its key's doing."""
    guard, clock, backend = setup()
    victim = Running(guard, backend, "victim", request(GRAMMAR + "# v\n"))
    clock.advance(5)
    attacker = Running(guard, backend, "attacker", request())
    clock.advance(2)
    attacker.end()  # (its client gone: no answer)
    for _ in range(3):
        clock.advance(1)
        guard.reading(reading(2.0, running=2, in_flight=1))
    assert victim.why is None
    clock.advance(2)
    guard.reading(reading(0.01, running=1, in_flight=1))
    guard.reading(reading(0.01, running=1, in_flight=1))
    assert stops(guard, "cause") == 1
    assert guard.kept(request(GRAMMAR + "# other\n"), "attacker") is not None
    assert guard.kept(request(GRAMMAR + "# v\n"), "victim") is None and victim.why is None
    # one whose answer came whole had been let go: no wait for it, and no suspect
    finisher = Running(guard, backend, "bystander", request(GRAMMAR + "# b\n"))
    finisher.guard.ended(finisher.watched, finished=True)
    guard.reading(reading(2.0, running=1, in_flight=1))
    guard.reading(reading(2.0, running=1, in_flight=1))
    assert victim.why is not None, "the one running stopped at once"
    victim.end()


def test_a_recovery_as_a_request_ended_where_another_process_ran_requests_strikes_no_one() -> None:
    guard, clock, backend = setup()
    attacker = Running(guard, backend, "attacker", request())
    attacker.end()
    for _ in range(3):
        clock.advance(1)
        guard.reading(reading(2.0, running=3, in_flight=0))  # (two of another worker's there)
    clock.advance(8)
    guard.reading(reading(0.01, running=2, in_flight=0))
    guard.reading(reading(0.01, running=2, in_flight=0))
    assert stops(guard, "cause") == 0 and guard.kept(request(), "attacker") is None


def test_a_reading_that_timed_out_is_slow_whatever_the_threshold() -> None:
    """Sweep 30: stall_seconds raised to 5 s for a slow engine, past what a reading may wait (scrape.timeout 2 s):
    no reading could reach it, and a grammar holding every step at 4 s ran unstopped."""
    guard, _clock, backend = setup(stall_seconds=5.0)
    running = Running(guard, backend, "a", request())
    guard.reading(reading(1.9, running=None))
    guard.reading(reading(1.9, running=None))
    assert running.why is not None
    running.end()


def test_with_no_usual_yet_the_loops_step_alone_as_measured_sets_the_threshold() -> None:
    """Sweep 30: a gateway just started (or one whose requests always had a grammar beside them) knew no usual,
    its threshold stall_seconds, and a grammar holding every step at 0.2-0.7 s ran unstopped (another key's p50
    0.09 -> 30 s). The pool measures an idle engine's step alone; times the sequences running, that is the usual
    until one is learnt."""
    guard, clock, backend = setup()
    assert guard.stall("l") == 1.0
    assert guard.wants_alone("l") and not guard.wants_alone("l"), "asked once, not again at once"
    guard.alone("l", 0.0025)
    assert guard.stall("l") == STALL_FLOOR and guard.stall("l", 2) == STALL_FLOOR
    assert guard.stall("l", 10) == pytest.approx(0.2), "a step of ten takes at most ten alone"
    attacker = Running(guard, backend, "a", request())
    guard.reading(reading(0.3, running=2, in_flight=2))
    guard.reading(reading(0.3, running=2, in_flight=2))
    assert attacker.why is not None
    attacker.end()
    clock.advance(ALONE_EVERY + 1)
    assert guard.wants_alone("l"), "asked again while no usual is learnt"
    for _ in range(USUAL_LEAST + 1):  # (the first gives the stopped request's verdict)
        guard.reading(reading(0.02, running=1, in_flight=1))
    clock.advance(ALONE_EVERY + 1)
    assert not guard.wants_alone("l"), "a usual learnt: no more measures"
    off, _clock, _backend = setup(measure_alone=False)
    assert not off.wants_alone("l")


@pytest.mark.anyio
async def test_llamacpp_is_measured_by_its_own_timing_of_a_few_tokens() -> None:
    adapter = create_adapter("llamacpp")
    sent: list[dict[str, Any]] = []

    def answer(timings: Any) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            sent.append(json.loads(request.content))
            return httpx.Response(200, json={"content": "x y z", "timings": timings})
        return httpx.MockTransport(handler)

    async with httpx.AsyncClient(transport=answer({"predicted_per_token_ms": 2.5, "predicted_n": 8}),
                                 base_url="http://l") as client:
        assert await adapter.measure_step(client) == pytest.approx(0.0025)
    assert sent[0]["ignore_eos"] is True and sent[0]["cache_prompt"] is False and "grammar" not in sent[0]
    for garbage in ({"predicted_per_token_ms": "2.5", "predicted_n": 8}, {"predicted_per_token_ms": 2.5,
                    "predicted_n": 1}, {"predicted_per_token_ms": -1, "predicted_n": 8}, None):
        async with httpx.AsyncClient(transport=answer(garbage), base_url="http://l") as client:
            assert await adapter.measure_step(client) is None, garbage


def test_a_request_that_turns_cheap_as_anothers_is_stopped_gets_no_one_convicted() -> None:
    """Sweep 30: a schema slow for ~5 s, then cheap, running on: the guard stopped the victim's older stream, the
    loop recovered as the schema's slow part ended, no request had ended, and the victim was convicted. Another
    key's request still running there may have changed its pace: no one is struck."""
    guard, clock, backend = setup()
    victim = Running(guard, backend, "victim", request(GRAMMAR + "# v\n"))
    clock.advance(1)
    attacker = Running(guard, backend, "attacker", request())
    clock.advance(1)
    guard.reading(reading(0.01, running=2, in_flight=2))  # (both begun before the loop was last fine)
    clock.advance(1)
    stall_and_stop(guard)
    assert victim.why is not None and attacker.why is None, "the longest-running"
    victim.end()
    clock.advance(GRACE)
    guard.reading(reading(0.01, running=1, in_flight=1))  # (the attacker's slow part over: it runs on, cheap)
    assert stops(guard, "cause") == 0 and stops(guard, "unresolved") == 1
    assert guard.kept(request(GRAMMAR + "# v\n"), "victim") is None
    attacker.end()


def test_requests_whose_answers_came_whole_while_the_loop_was_slow_still_are_not_why_it_recovered() -> None:
    """Sweep 30's re-run: a tenant's short JSON requests finishing in the stall of another key's request whose
    client had left kept that key unstruck. One whose answer came whole before the last slow reading had left the
    engine while it was still slow."""
    guard, clock, backend = setup()
    attacker = Running(guard, backend, "attacker", request())
    clock.advance(1)
    attacker.end()  # (its client gone)
    for n in range(4):
        clock.advance(1)
        done = Running(guard, backend, "victim", request(GRAMMAR + f"# {n}\n"))
        guard.ended(done.watched, finished=True)  # (a short JSON answer, done in the stall)
        clock.advance(0.5)
        guard.reading(reading(2.0, running=2, in_flight=1))
    clock.advance(2)
    guard.reading(reading(0.01, running=1, in_flight=1))
    guard.reading(reading(0.01, running=1, in_flight=1))
    assert stops(guard, "cause") == 1 and guard.kept(request(), "attacker") is not None
    assert guard.kept(request(GRAMMAR + "# v\n"), "victim") is None
