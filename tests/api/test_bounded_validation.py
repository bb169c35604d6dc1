"""Every CPU-heavy validation of a client's constraint is bounded: past a limit, a 400 naming it at once; too
deep, a 400 and never a 500 with a traceback; too big for the event loop, validated in a worker process while
the gateway keeps answering; too slow, a 400 at the deadline."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.sim import FleetThread, SimSpec
from gateway.structured import checks, offload
from gateway.structured.checks import Verdict
from tests.api.conftest import TIME_SCALE, Running, gateway_settings
from tests.conftest import serve_in_thread

ASK: Any = [{"role": "user", "content": "Answer."}]


def chain_grammar(rules: int) -> str:
    """The grammar that froze the gateway for 42 s: each rule refers to the next (206 KB at 12,000 rules)."""
    lines = ["root ::= r1"] + [f'r{i} ::= "a" r{i + 1}' for i in range(1, rules)] + [f'r{rules} ::= "a"']
    return "\n".join(lines) + "\n"


def long_grammar(rules: int, last: str) -> str:
    """A grammar of ``rules`` rules (~45 bytes each) whose last one refers to ``last``."""
    lines = ["root ::= r1"] + [f'r{i} ::= "word-{i}" [a-z]* ("," [0-9]+)? r{i + 1}' for i in range(1, rules)]
    return "\n".join([*lines, f'r{rules} ::= "end" {last}', 'end ::= "."']) + "\n"


def deep_schema(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


def sdk(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0, timeout=60)


def refused(running: Running, model: str = "m-vllm", **fields: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        sdk(running).chat.completions.create(model=model, messages=ASK, max_tokens=5, **fields)
    return err.value


class Parsed:
    """The grammars the gateway parsed: ``here`` (in this process, on its event loop) and ``in_worker`` (sent to a
    validation worker). With ``hold`` set, the next one validated in a worker is held once its verdict is in
    (``held`` set) until ``release``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.here: list[str] = []
        self.in_worker: list[str] = []
        self.hold = False
        self.held = threading.Event()
        self.released = asyncio.Event()  # (waited on and set on the gateway's loop)
        self._loop = loop

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self.released.set)


@pytest.fixture
def parsed(engines: Running, monkeypatch: pytest.MonkeyPatch) -> Iterator[Parsed]:
    assert engines.gateway.loop is not None
    seen = Parsed(engines.gateway.loop)
    parse, run = checks.parse_grammar, offload.ValidationWorkers._run

    def parse_here(text: str, *args: Any) -> Any:
        seen.here.append(text)
        return parse(text, *args)

    async def run_in_worker(workers: offload.ValidationWorkers, job: list[Any], param: str, owner: str) -> Verdict:
        hold, seen.hold = seen.hold, False
        seen.in_worker.append(job[1])
        verdict = await run(workers, job, param, owner)
        if hold:  # (its deadline and its worker's slot are behind it)
            seen.held.set()
            await seen.released.wait()
        return verdict

    monkeypatch.setattr(checks, "parse_grammar", parse_here)
    monkeypatch.setattr(offload.ValidationWorkers, "_run", run_in_worker)
    try:
        yield seen
    finally:
        seen.release()


@pytest.fixture
def no_tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    loud = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not loud, [r.getMessage() for r in loud]


def test_the_12000_rule_grammar_is_refused_at_once_naming_the_limit(engines: Running, no_tracebacks: None,
                                                                    parsed: Parsed) -> None:
    grammar = chain_grammar(12_000)
    small = refused(engines, extra_body={"regex": "("})
    err = refused(engines, model="m-llamacpp", extra_body={"grammar": grammar})
    assert small.code == "invalid_constraint"
    assert err.code == "constraint_too_large" and err.param == "grammar"
    assert "limits.max_constraint_bytes = 131072" in err.message
    # refused by its size, never parsed (the old code parsed it, for 42 s): not here, not in a worker
    assert grammar not in parsed.here and grammar not in parsed.in_worker


@pytest.mark.parametrize(("fields", "param", "code", "limit"), [
    ({"regex": "(" * 5000 + "a" + ")" * 5000}, "regex", "constraint_too_deep", "max_nesting"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(400)}}},
     "response_format.json_schema.schema", "constraint_too_deep", "max_nesting"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep_schema(70)}}},
     "response_format.json_schema.schema", "constraint_too_deep", "max_nesting"),
    ({"json_schema": '{"items":' * 2000 + "{}" + "}" * 2000}, "json_schema", "constraint_too_deep", "max_nesting"),
    ({"grammar": "root ::= " + '("a" ' * 100 + ")" * 100}, "grammar", "constraint_too_deep", "max_nesting"),
    ({"grammar": 'root ::= "a"' + "*" * 100}, "grammar", "constraint_too_deep", "max_nesting"),
    ({"grammar": "start: " + '("a" ' * 100 + ")" * 100, "grammar_syntax": "lark"}, "grammar",
     "constraint_too_deep", "max_nesting"),
    ({"grammar": "start: /" + "(" * 100 + "a" + ")" * 100 + "/", "grammar_syntax": "lark"}, "grammar",
     "constraint_too_deep", "max_nesting"),
    ({"ebnf": 'root ::= Regex("' + "(" * 100 + "a" + ")" * 100 + '")'}, "ebnf", "constraint_too_deep",
     "max_nesting"),
    ({"grammar": chain_grammar(2_500)}, "grammar", "constraint_too_large", "max_grammar_rules"),
    ({"choice": ["x" * 1000] * 200}, "choice", "constraint_too_large", "max_constraint_bytes"),
])
def test_constraints_past_a_limit_are_the_clients_400_naming_it(engines: Running, no_tracebacks: None,
                                                                 fields: dict[str, Any], param: str, code: str,
                                                                 limit: str) -> None:
    model = "m-tabbyapi" if fields.get("grammar_syntax") == "lark" else "m-vllm"
    err = refused(engines, model=model, extra_body=fields)
    assert (err.code, err.param) == (code, param), err.message
    assert f"limits.{limit}" in err.message
    assert len(err.response.content) < 2000  # a message, not a traceback


def test_health_answers_while_heavy_constraints_are_validated_in_a_worker(engines: Running, no_tracebacks: None,
                                                                          parsed: Parsed) -> None:
    """Grammars too big for the event loop are parsed in a worker process, the ones past a limit not at all: the
    loop answers /health while they are under way (one held once validated, until it has)."""
    http = httpx.Client(base_url=engines.url, timeout=60)

    def post(fields: dict[str, Any]) -> httpx.Response:
        return httpx.post(engines.url + "/v1/chat/completions", timeout=60,
                          json={"model": "m-llamacpp", "messages": ASK, "max_tokens": 5, **fields})

    heavy = [{"grammar": chain_grammar(12_000)}] * 10  # refused by size
    # within every limit but invalid at its very end: each is parsed whole, in a worker process
    heavy += [{"grammar": long_grammar(1_900, f"undefined-{i}")} for i in range(10)]
    parsed.hold = True
    with ThreadPoolExecutor(10) as pool:
        try:
            posted = [pool.submit(post, fields) for fields in heavy]
            assert parsed.held.wait(60), "no grammar was validated in a worker"
            health = [http.get("/health").status_code for _ in range(5)]
            assert not all(f.done() for f in posted), "the heavy requests ended before /health was asked"
        finally:
            parsed.release()
        answers = [f.result() for f in posted]
    assert health == [200] * 5
    assert [a.status_code for a in answers] == [400] * len(heavy)
    assert {a.json()["error"]["code"] for a in answers} == {"constraint_too_large", "invalid_constraint"}
    assert "undefined rule 'undefined-3'" in answers[13].json()["error"]["message"]
    assert sorted(parsed.in_worker) == sorted(fields["grammar"] for fields in heavy[10:])
    assert not any(fields["grammar"] in parsed.here for fields in heavy)


def test_constraints_too_big_for_the_event_loop_are_validated_in_a_worker(engines: Running,
                                                                          no_tracebacks: None) -> None:
    c = sdk(engines)
    grammar = long_grammar(60, "end")  # ~2.7 KB: validated and converted to EBNF in a worker
    reply = c.chat.completions.create(model="m-sglang", messages=ASK, max_tokens=400, extra_body={"grammar": grammar})
    assert reply.choices[0].message.content
    sent = [r for r in list(engines.server("sim-sglang").received) if r.path == "/v1/chat/completions"][-1].body
    assert "r60 ::=" in sent["ebnf"]  # the worker's EBNF rendering, as the routing and the adapter used it
    schema: Any = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(60)},
                   "required": ["field_0"]}
    reply = c.chat.completions.create(model="m-vllm", messages=ASK, max_tokens=400,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "wide", "schema": schema}})
    assert "field_0" in (reply.choices[0].message.content or "")
    schema["properties"]["field_59"] = {"type": "integr"}
    err = refused(engines, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    assert err.code == "invalid_constraint" and "not a valid JSON schema" in err.message
    err = refused(engines, model="m-llamacpp", extra_body={"grammar": "root ::= " + '("a" ' * 2000 + ")" * 2000})
    assert err.code == "constraint_too_deep" and "limits.max_nesting" in err.message
    err = refused(engines, extra_body={"regex": "()" * 3000 + "(" * 100 + ")" * 100})
    assert err.code == "constraint_too_deep"


def test_a_constraint_that_cannot_be_validated_before_the_deadline_is_a_400(no_tracebacks: None) -> None:
    specs = [SimSpec(engine="vllm", model="m", name="vllm", time_scale=TIME_SCALE)]
    with FleetThread(specs) as fleet:
        # a worker warms up before it says it is ready, so the small schema's check below takes ~10 ms: 0.2 s
        # leaves it room on a loaded machine, and the big one needs several times that
        limits = {"validation_timeout": 0.2, "max_constraint_bytes": 512 * 1024}
        app = create_app(gateway_settings(fleet.fleet.servers, limits=limits))
        with serve_in_thread(app) as gw:
            running = Running(fleet, gw, app)
            # ~300 KB, valid: jsonschema needs about 1 s for it
            big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 20,
                                                                   "description": "some words"}
                                                    for i in range(3600)}}
            err = refused(running, model="m", response_format={"type": "json_schema",
                                                              "json_schema": {"name": "big", "schema": big}})
            assert err.code == "constraint_too_complex" and "limits.validation_timeout" in err.message
            small: Any = {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(30)}}
            reply = sdk(running).chat.completions.create(  # a fresh worker replaced the one killed
                model="m", messages=ASK, max_tokens=100,
                response_format={"type": "json_schema", "json_schema": {"name": "small", "schema": small}})
            assert reply.choices[0].message.content
