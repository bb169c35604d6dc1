"""Checking finished answers against their constraints (``structured_output.validate_outputs``) runs in the
validation workers, under ``limits.output_check_timeout``, never on the event loop.

Sweep 7 found four shapes whose check the cost count missed, each holding the event loop 3-11 s for every other
tenant: a ``pattern`` counted as one application that searches for milliseconds, applied 499 times; hundreds of
``patternProperties`` recompiled past ``re``'s cache; the count's own walk of a 120 KB schema repeated per call;
and a call skipped as over budget not spending it, so each later call counted again. These tests hold the
gateway to what it promises for all of them at once: the check runs elsewhere, ends at its deadline with the
answer passed unchecked (and saying so), and the worker that ran it lives on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import LimitSettings
from gateway.structured.constraint import Constraint
from gateway.structured.offload import ValidationWorkers
from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over

pytestmark = pytest.mark.system

# a pattern each search of which is bounded (so the count lets it run), applied 499 times to one string
SLOW_PATTERN = "(?:(?:[a-z][a-z]){10}){50}0"
SLOW_SCHEMA = {"type": "object", "$defs": {"p": {"pattern": SLOW_PATTERN}},
               "properties": {"x": {"type": "array", "items": {"allOf": [{"$ref": "#/$defs/p"}] * 499}}}}
SLOW_VALUE = {"x": ["a" * 4000]}
SMALL_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _answer(content: Any) -> bytes:
    message = {"role": "assistant", "content": orjson.dumps(content).decode()}
    return orjson.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m",
                         "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}})


def _text_answer(text: str) -> bytes:
    return orjson.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})


def _pid(workers: ValidationWorkers) -> int | None:
    worker = workers._workers[0]
    return worker.process.pid if worker is not None else None


@contextlib.asynccontextmanager
async def _started(output_check_timeout: float) -> AsyncIterator[tuple[ValidationWorkers, int | None]]:
    """One validation worker, started by a first (small) check, and its process id; closed after."""
    workers = ValidationWorkers(LimitSettings(output_check_timeout=output_check_timeout), workers=1)
    try:
        await workers.check_answer("chat", _answer({"n": 1}),
                                   Constraint("json_schema", "response_format", schema=SMALL_SCHEMA), "a")
        yield workers, _pid(workers)
    finally:
        await workers.close()


def test_an_answer_check_past_its_deadline_passes_unchecked_and_its_worker_lives_on() -> None:
    slow = Constraint("json_schema", "response_format", schema=SLOW_SCHEMA)
    small = Constraint("json_schema", "response_format", schema=SMALL_SCHEMA)

    async def run() -> None:
        async with _started(0.3) as (workers, first):
            assert await workers.check_answer("chat", _answer({"n": 2}), small, "a") == (None, None)
            problem, unchecked = await workers.check_answer("chat", _answer(SLOW_VALUE), slow, "a")
            assert problem is None and unchecked is not None and "deadline" in unchecked
            # the deadline was the worker's own timer: the same worker checks the next answer, and finds it wrong
            problem, unchecked = await workers.check_answer("chat", _answer({"n": "one"}), small, "b")
            assert unchecked is None and problem is not None and "is not of type 'integer'" in problem
            assert _pid(workers) == first

    asyncio.run(run())


def test_a_client_that_leaves_mid_check_does_not_cost_the_worker() -> None:
    """Killing the worker when a client leaves would cost every key's next check a worker's start (~1 s): the
    check runs out to its own deadline instead, and its slot is free after it."""
    slow = Constraint("json_schema", "response_format", schema=SLOW_SCHEMA)
    small = Constraint("json_schema", "response_format", schema=SMALL_SCHEMA)

    async def run() -> None:
        async with _started(0.5) as (workers, first):
            leaving = asyncio.create_task(workers.check_answer("chat", _answer(SLOW_VALUE), slow, "a"))
            await asyncio.sleep(0)  # (it takes the free worker without waiting and sends the job: one step each)
            await asyncio.sleep(0)
            assert not workers._slots._free and not leaving.done()
            leaving.cancel()
            assert (await asyncio.gather(leaving, return_exceptions=True))[0].__class__ is asyncio.CancelledError
            assert workers._finishing  # (its check runs out in the worker, to its own deadline)
            await asyncio.gather(*workers._finishing)
            # then the worker, the same one, is free for the next key's check
            problem, unchecked = await workers.check_answer("chat", _answer({"n": "x"}), small, "b")
            assert unchecked is None and problem is not None
            assert _pid(workers) == first and not workers._finishing

    asyncio.run(run())


def test_a_slow_answer_check_holds_no_other_request_and_says_it_was_not_checked() -> None:
    """Through the gateway: while one key's answer is checked to its deadline, another request is answered
    (it finishes first), and the slow answer reaches its client whole, marked unchecked and counted."""
    with ScriptedUpstream(mode="script", model="m", every=0.001) as upstream:
        answers = {"slow": _answer(SLOW_VALUE), "wrong": _answer({"n": "one"})}
        which = ["slow"]
        upstream.script = lambda headers: (200, "application/json", [answers[which[0]]])
        _, server = gateway_over(upstream, structured_output={"validate_outputs": "mark"},
                                 limits={"output_check_timeout": 2.0})
        with server as gw:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SLOW_SCHEMA}}}
            with httpx.Client(timeout=30) as client:
                assert client.get(gw.url + "/v1/models").status_code == 200
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    slow = pool.submit(client.post, gw.url + "/v1/chat/completions", json=body)
                    while upstream.posts == 0 and not slow.done():
                        concurrent.futures.wait([slow], timeout=0.01)
                    other = client.get(gw.url + "/v1/models")
                    assert other.status_code == 200 and not slow.done()
                    answered = slow.result()
                assert answered.status_code == 200 and answered.content == answers["slow"]
                assert "deadline" in answered.headers["x-gateway-output-unchecked"]
                assert "x-gateway-output-invalid" not in answered.headers
                which[0] = "wrong"
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": SMALL_SCHEMA}}
                wrong = client.post(gw.url + "/v1/chat/completions", json=body)
                assert "is not of type 'integer'" in wrong.headers["x-gateway-output-invalid"]
                assert "x-gateway-output-unchecked" not in wrong.headers
                metrics = client.get(gw.url + "/metrics").text
    assert 'gateway_structured_output_unchecked_total{backend="scripted",engine="openai"} 1.0' in metrics
    assert 'gateway_structured_output_invalid_total{action="marked",backend="scripted",engine="openai"} 1.0' \
        in metrics


def test_an_re2_match_is_counted_before_it_runs_so_the_worker_is_never_killed() -> None:
    """Sweep 8: RE2 runs in C and never yields to the worker's timer. A 614-character regex of 20,000 positions
    matched against 24,000 characters took 1.7 s; the worker was killed at its deadline each time, and every key's
    next check waited for a new one. Its work (program size x text) is now counted first."""
    pattern = "[ab]*a" + "[ab]{1000}" * 20 + "c"
    regex = Constraint("regex", "regex", pattern=pattern)
    patterned = Constraint("json_schema", "response_format", schema={
        "type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}})

    async def run() -> None:
        async with _started(5.0) as (workers, first):
            for constraint, raw in ((regex, _text_answer("a" * 24_000)), (patterned, _answer({"s": "a" * 24_000}))):
                problem, unchecked = await workers.check_answer("chat", raw, constraint, "a")
                assert problem is None and unchecked is not None and "automaton steps" in unchecked, unchecked
            assert _pid(workers) == first  # (no deadline reached, nothing killed)
            # an ordinary pattern is still matched by RE2 and found wrong
            ordinary = Constraint("regex", "regex", pattern="(a+)+$")
            assert await workers.check_answer("chat", _text_answer("a" * 40 + "b"), ordinary, "a") == (
                "the answer does not match the regex", None)

    asyncio.run(run())
