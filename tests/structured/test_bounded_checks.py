"""Constraint validation within limits: each limit refused by name and code, the deepest inputs the limits
allow validated without overflowing Python's stack, the work left to a worker, and answer checks that
cannot run away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest

from gateway.config import LimitSettings
from gateway.structured import Constraint, ConstraintInvalid, check, extract, grammar_in
from gateway.structured.bounds import Bounds, json_depth
from gateway.structured.check import answer_verdict
from gateway.structured.checks import _inline_schema, check_grammar, run_check
from gateway.structured.offload import ValidationBusy, ValidationWorkers
from gateway.structured.regex_cost import steps

pytestmark = pytest.mark.unit

SMALL = LimitSettings(max_nesting=8, max_constraint_bytes=2000, max_grammar_rules=5)


def output_problem(route: str, raw: bytes, constraint: Constraint) -> str | None:
    """Why the answer fails its constraint (None: it passes), asserting it was checked."""
    problem, unchecked = answer_verdict(route, raw, constraint)
    assert unchecked is None, unchecked
    return problem


def unchecked(route: str, raw: bytes, constraint: Constraint) -> str:
    """Why the answer was passed unchecked, asserting it was."""
    problem, why = answer_verdict(route, raw, constraint)
    assert problem is None and why is not None, (problem, why)
    return why


def nested_schema(levels: int, key: str = "items") -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        node = {key: node} if key == "items" else {"type": "object", "properties": {"a": node}}
    return node


def rules(count: int) -> str:
    return "\n".join(["root ::= r1", *(f'r{i} ::= "a" r{i + 1}' for i in range(1, count - 1)), f'r{count - 1} ::= "a"'])


@pytest.mark.parametrize(("ok", "too_far", "code", "limit"), [
    ({"regex": "(" * 8 + "a" + ")" * 8}, {"regex": "(" * 9 + "a" + ")" * 9}, "constraint_too_deep", "max_nesting"),
    ({"regex": "\\(" + "(" * 8 + "[(]a" + ")" * 8}, {"regex": "(" * 9 + "[)]" + ")" * 9}, "constraint_too_deep",
     "max_nesting"),
    ({"json_schema": nested_schema(7)}, {"json_schema": nested_schema(8)}, "constraint_too_deep", "max_nesting"),
    ({"grammar": "root ::= " + '("a" ' * 8 + ")" * 8}, {"grammar": "root ::= " + '("a" ' * 9 + ")" * 9},
     "constraint_too_deep", "max_nesting"),
    ({"grammar": 'root ::= "a"' + "?" * 8}, {"grammar": 'root ::= "a"' + "?" * 9}, "constraint_too_deep",
     "max_nesting"),
    ({"grammar": "start: " + '["a" ' * 8 + "]" * 8, "grammar_syntax": "lark"},
     {"grammar": "start: " + '["a" ' * 9 + "]" * 9, "grammar_syntax": "lark"}, "constraint_too_deep", "max_nesting"),
    ({"grammar": 'start: ("a" /(((a)))/)', "grammar_syntax": "lark"},
     {"grammar": 'start: ("a" /((((((((a))))))))/)', "grammar_syntax": "lark"}, "constraint_too_deep", "max_nesting"),
    ({"grammar": rules(5)}, {"grammar": rules(6)}, "constraint_too_large", "max_grammar_rules"),
    ({"regex": "a" * 2000}, {"regex": "a" * 2001}, "constraint_too_large", "max_constraint_bytes"),
    ({"regex": "é" * 1000}, {"regex": "é" * 1001}, "constraint_too_large", "max_constraint_bytes"),
    ({"choice": ["ab"] * 1000}, {"choice": ["ab"] * 1000 + ["c"]}, "constraint_too_large", "max_constraint_bytes"),
    ({"json_schema": {"enum": ["x" * 1980]}}, {"json_schema": {"enum": ["x" * 1990]}}, "constraint_too_large",
     "max_constraint_bytes"),
])
def test_each_limit_is_refused_by_name_just_past_it(ok: dict[str, Any], too_far: dict[str, Any], code: str,
                                                    limit: str) -> None:
    assert extract(ok, SMALL) is not None
    with pytest.raises(ConstraintInvalid) as err:
        extract(too_far, SMALL)
    assert err.value.code == code and f"limits.{limit} = " in str(err.value)
    assert err.value.param in too_far


def test_a_schema_nested_in_the_request_body_is_measured_as_a_document() -> None:
    assert json_depth({"a": [{"b": []}]}, 10) == (4, "/a/0/b", True)
    assert json_depth([[[[]]]], 2)[0] == 3  # stops once past the limit
    assert json_depth([[]] * 100, 10, max_nodes=5)[2] is False


def call_deep(frames: int, work: Callable[[], Any]) -> Any:
    """``work`` called with ``frames`` frames already on the stack (a server's stack, and then some)."""
    return call_deep(frames - 1, work) if frames else work()


DEEPEST = LimitSettings(max_nesting=200)  # the most max_nesting may be set to


@pytest.mark.parametrize("body", [
    {"regex": "(" * 200 + "a" + ")" * 200},
    {"regex": "(?:a|" * 200 + "b" + ")" * 200},
    {"regex": "(?:a{2,5}|(?:" * 100 + "b" + "))" * 100},
    # (each level closed by "d": without it a run of b's could nest any way, more than llama.cpp should follow)
    {"grammar": "root ::= " + '("a" | "b" (' * 100 + '"c"' + ')* "d")*' * 100},
    {"grammar": "root ::= " + '("a" ' * 199 + '"b"*' + ")" * 199},
    {"ebnf": "root ::= " + '("a" ' * 100 + 'Regex("' + "(a|" * 100 + "b" + ")" * 100 + '")' + ")" * 100},
    {"grammar": "start: " + '["a" | ["b" ' * 14 + "/" + "(a|" * 172 + "b" + ")" * 172 + "/" + "]]" * 14,
     "grammar_syntax": "lark"},  # Lark: 28 levels of brackets at most (llguidance's limit), the rest in a regex
])
def test_the_deepest_constraints_the_limits_allow_never_overflow_the_stack(body: dict[str, Any]) -> None:
    bounds = Bounds.of(DEEPEST)

    def validated(body: dict[str, Any]) -> Constraint:
        found = call_deep(100, lambda: extract(body, DEEPEST))
        assert isinstance(found, Constraint)
        if found.pending is None:
            return found
        # too big for the event loop: what a worker would run, here, with no more stack than the server has
        text = found.grammar if found.kind == "grammar" else found.pattern
        verdict = call_deep(100, lambda: run_check(found.kind, text, found.dialect, found.pending or "", bounds))
        if verdict.problem is not None:
            raise ConstraintInvalid(verdict.problem, found.pending or "", verdict.code)
        return replace(found, renderings=verdict.renderings, pending=None)

    constraint = validated(body)
    if constraint.kind == "grammar" and constraint.dialect == "gbnf":
        assert grammar_in(constraint, ["ebnf"]) is not None  # converted as well
    deeper = {key: value.replace("(", "((", 1) if isinstance(value, str) and key != "grammar_syntax" else value
              for key, value in body.items()}
    with pytest.raises(ConstraintInvalid) as err:  # and one level more is refused
        validated(deeper)
    assert err.value.code == "constraint_too_deep"


@pytest.mark.system
def test_the_deepest_schemas_go_to_a_worker_that_has_the_stack_for_them() -> None:
    schemas = [nested_schema(199), {"allOf": [nested_schema(98, "properties")]}]
    pending = [extract({"json_schema": schema}, DEEPEST) for schema in schemas]
    assert all(c is not None and c.pending == "json_schema" for c in pending)

    async def validate_all() -> list[Constraint]:
        workers = ValidationWorkers(DEEPEST, workers=1)
        try:
            return [await workers.validate(c, "k") for c in pending if c is not None]
        finally:
            await workers.close()

    assert all(c.pending is None for c in asyncio.run(validate_all()))
    answer = orjson.dumps({"choices": [{"message": {"content": orjson.dumps([[[["x"]]]]).decode()}}]})
    schema = pending[0]
    assert schema is not None and call_deep(100, lambda: output_problem("chat", answer, schema)) is None


def test_work_too_big_for_the_event_loop_is_left_to_a_worker() -> None:
    big_schema = {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(40)}}
    big_grammar = 'root ::= "a" [0-9]\n# ' + "x" * 2000  # past the size checked on the event loop
    bodies: list[dict[str, Any]] = [{"json_schema": big_schema}, {"grammar": big_grammar}, {"regex": "(ab|cd)" * 300}]
    for body in bodies:
        constraint = extract(body)
        assert constraint is not None and constraint.pending == next(iter(body))
    grammar, fanout = check_grammar(big_grammar, "gbnf", "grammar", Bounds(), inline=False)
    assert [dialect for dialect, _ in grammar] == ["gbnf", "ebnf"] and fanout is None
    payload = orjson.dumps({**big_schema, "required": "f1"}).decode()
    verdict = run_check("json_schema", payload, "gbnf", "json_schema", Bounds())
    assert verdict.problem is not None and "not a valid JSON schema" in verdict.problem
    assert run_check("regex", "(ab|cd)" * 300, "gbnf", "regex", Bounds()).problem is None


@pytest.mark.system
def test_a_worker_past_the_deadline_is_killed_and_replaced_and_verdicts_are_remembered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slow = {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 20,
                                                            "description": "some words"} for i in range(1200)}}
    fast = {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(40)}}

    workers = ValidationWorkers(LimitSettings(validation_timeout=0.05), workers=1)
    runs: list[str] = []
    run = workers._run

    async def counted(job: list[Any], param: str, owner: str) -> Any:
        runs.append(job[0])
        return await run(job, param, owner)

    monkeypatch.setattr(workers, "_run", counted)

    async def scenario() -> list[Any]:
        outcomes: list[Any] = []
        try:
            for schema in (slow, fast, fast):
                constraint = extract({"json_schema": schema})
                assert constraint is not None
                try:
                    outcomes.append((await workers.validate(constraint, "k")).pending)
                except ConstraintInvalid as exc:
                    outcomes.append(exc.code)
                # the replacement worker starts cold: on a loaded 2-core machine its first check of the small
                # schema took longer than 50 ms, so the fast ones get a deadline a fresh process can meet
                workers.set_limits(LimitSettings(validation_timeout=5.0))
        finally:
            await workers.close()
        return outcomes

    assert asyncio.run(scenario()) == ["constraint_too_complex", None, None]
    assert runs == ["json_schema", "json_schema"]  # the second fast one was remembered


@pytest.mark.system
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_worker_that_died_while_idle_is_replaced(loop: str) -> None:
    """Sweep 24: a worker killed while idle (a hang-up of the process group, the OOM killer) stayed in its slot for
    good under uvloop, whose closed pipe raises RuntimeError where asyncio's raises ConnectionResetError: every
    later check of every key failed (500, or 502 after the answer). It is started again when next needed."""
    import signal

    import uvloop

    big = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(200)}}
    # (deadlines a cold worker's start cannot miss on a loaded machine: what is tested is that it is started)
    workers = ValidationWorkers(LimitSettings(validation_timeout=30.0, output_check_timeout=30.0), workers=1)

    async def scenario() -> list[Any]:
        outcomes: list[Any] = []
        try:
            for round_ in range(3):
                constraint = extract({"json_schema": {**big, "title": f"round {round_}"}})
                assert constraint is not None and constraint.pending is not None
                outcomes.append((await workers.validate(constraint, "k")).pending)
                worker = workers._workers[0]
                assert worker is not None
                worker.process.send_signal(signal.SIGHUP if round_ == 0 else signal.SIGKILL)
                await worker.process.wait()  # (dead, and idle: nothing was asked of it since)
            answer = orjson.dumps({"choices": [{"message": {"content": '{"field_1": 1}'}}]})
            checked = extract({"json_schema": big})
            assert checked is not None
            outcomes.append(await workers.check_answer("chat", answer, replace(checked, pending=None), "k"))
        finally:
            await workers.close()
        return outcomes

    ran = asyncio.run(scenario()) if loop == "asyncio" else uvloop.run(scenario())
    assert ran == [None, None, None, (None, None)]


@pytest.mark.system
def test_a_worker_that_did_not_run_past_the_deadline_is_busy_not_the_constraints_fault() -> None:
    """Sweep 24: a SIGSTOPped idle worker made the next client's valid schema a 400 "too complex to validate".
    A check past its deadline is the constraint's fault only where the worker spent a quarter of it on the CPU;
    else the client is told to retry (503), and the worker is replaced."""
    import signal

    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(200)}}
    workers = ValidationWorkers(LimitSettings(validation_timeout=1.0, validation_queue_timeout=30.0), workers=1)

    async def scenario() -> list[Any]:
        outcomes: list[Any] = []
        try:
            for round_ in range(2):
                constraint = extract({"json_schema": {**schema, "title": f"round {round_}"}})
                assert constraint is not None
                try:
                    outcomes.append((await workers.validate(constraint, "k")).pending)
                except (ConstraintInvalid, ValidationBusy) as exc:
                    outcomes.append(type(exc).__name__)
                worker = workers._workers[0]
                if round_ == 0 and worker is not None:
                    worker.process.send_signal(signal.SIGSTOP)
        finally:
            await workers.close()
        return outcomes

    assert asyncio.run(scenario()) == [None, "ValidationBusy"]


@pytest.mark.parametrize(("schema", "words"), [
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
     "#/$defs/a -> #/$defs/b -> #/$defs/b/allOf/0 -> #/$defs/a"),
    ({"anyOf": [{"$ref": "#"}, {"type": "string"}]}, "# -> #/anyOf/0 -> #"),
])
def test_schemas_that_refer_back_to_themselves_in_place_are_refused(schema: dict[str, Any], words: str) -> None:
    with pytest.raises(ConstraintInvalid, match="cycle") as err:
        extract({"json_schema": schema})
    assert words in str(err.value)
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    assert extract({"json_schema": tree}) is not None  # recursion through the value is fine


def answer(text: str) -> bytes:
    return orjson.dumps({"choices": [{"message": {"content": text}}]})


def regex(pattern: str) -> Constraint:
    constraint = extract({"regex": pattern})
    assert constraint is not None
    return constraint


def test_answer_checks_that_could_run_away_in_re_are_matched_by_re2_in_linear_time() -> None:
    """Such answers used to pass unchecked (QA: 'b' against (a+)+ was never marked); Python's re takes seconds
    or more on each of these."""

    def by_re2(text: str, constraint: Constraint) -> str | None:
        """What ``output_problem`` says of the answer, once sure RE2 matched it (it counts what RE2 spends)."""
        problem = output_problem("chat", answer(text), constraint)
        assert check._re2_spent[0] > 0, "matched by Python's re"
        return problem

    mismatch = "the answer does not match the regex"
    assert by_re2("a" * 40 + "b", regex("(a+)+$")) == mismatch
    assert by_re2("b", regex("(a|aa)+")) == mismatch
    assert by_re2("a" * 40, regex("(a+)+$")) is None
    assert by_re2("a" * 3000, regex("a*a*a*b")) == mismatch  # ~2.5 s with re
    # 140 ms for re to compile, and RE2 does not read Python's \\U escapes: skipped
    assert "character ranges" in unchecked("chat", answer("x"), regex("[\\x00-\\U0010ffff]" * 20))
    hostile = extract({"json_schema": {"type": "object", "properties": {"s": {"pattern": "^(a+)+$"}}}})
    assert hostile is not None
    problem = by_re2(orjson.dumps({"s": "a" * 40 + "b"}).decode(), hostile)
    assert problem is not None and "does not match" in problem
    assert by_re2(orjson.dumps({"s": "a" * 40}).decode(), hostile) is None
    # a patternProperties key is matched by jsonschema's own re: still skipped when it could run away
    keyed = extract({"json_schema": {"type": "object", "patternProperties": {"^(a+)+$": {"type": "integer"}}}})
    assert keyed is not None
    assert "backtrack" in unchecked("chat", answer(orjson.dumps({"a" * 40 + "b": "x"}).decode()), keyed)
    assert output_problem("chat", answer("12-ab"), regex("[0-9]{2}-[a-z]{3}")) == "the answer does not match the regex"
    assert output_problem("chat", answer('{"name": "' + "x" * 100 + '", "n": 1}'),
                          regex('\\{"name": "[^"]*", "n": [0-9]+\\}')) is None
    assert steps("[a-z]+@[a-z]+", 10) is not None and steps("(a|ab)*c", 10) is None


def test_answer_checks_against_schemas_stay_bounded() -> None:
    tree = extract({"json_schema": {"type": "object", "properties": {"c": {"$ref": "#"}}}})
    strings = extract({"json_schema": {"type": "array", "items": {"type": "string"}}})
    assert tree is not None and strings is not None
    deep: Any = {}
    for _ in range(200):
        deep = {"c": deep}
    assert "nests deeper" in unchecked("chat", answer(orjson.dumps(deep).decode()), tree)
    assert output_problem("chat", answer('{"c": 1}'), tree) is not None
    assert "longer than" in unchecked("chat", answer(orjson.dumps(["x"] * 20000).decode()), strings)
    assert output_problem("chat", answer("[1]"), strings) is not None


def test_conversions_are_found_once_by_validation() -> None:
    gbnf = extract({"grammar": 'root ::= "a" [0-9]'})
    ebnf_only = extract({"ebnf": 'root ::= Regex("[a-z]+")'})
    assert gbnf is not None and ebnf_only is not None
    assert [d for d, _ in gbnf.renderings] == ["gbnf", "ebnf"]
    assert [d for d, _ in ebnf_only.renderings] == ["ebnf"]
    manual = Constraint("grammar", "grammar", grammar='root ::= "a"', dialect="gbnf")
    assert grammar_in(manual, ["ebnf"]) is None  # nothing is parsed when routing asks


def test_small_constraints_are_validated_on_the_event_loop_once() -> None:
    """The common case: validated inline, and a client's repeated schema is not checked again."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    first = extract(body)
    hits = _inline_schema.cache_info().hits
    again = extract(body)
    assert first is not None and again is not None and first.pending is None and again.pending is None
    assert _inline_schema.cache_info().hits == hits + 1


def test_a_structural_tag_carrying_many_grammars_is_checked_in_a_worker() -> None:
    """The final sweep: a tag of 120 grammars of about 1 KiB each (within max_constraint_bytes) had each parsed on
    the event loop, 0.4 s a request, and a bad regex put first was found only after all of them (nodes were
    checked last-first), so a request refused with a 400 still held every tenant's requests. Now the tag's shape
    is checked first, and what its nodes carry goes to a worker once together it passes one small grammar."""
    grammar = 'root ::= "a" ("b" | "c")*\n' + "".join(f'r{i} ::= "x{i}"\n' for i in range(70))
    assert 900 < len(grammar) < 1024
    nodes: list[dict[str, Any]] = [{"type": "grammar", "grammar": grammar} for _ in range(100)]
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": nodes}}
    constraint = extract({"response_format": tag})
    assert constraint is not None and constraint.pending == "response_format"
    bad = {**tag, "format": {"type": "sequence", "elements": [{"type": "regex", "pattern": "(?=x)"}, *nodes]}}
    constraint = extract({"response_format": bad})
    assert constraint is not None and constraint.pending == "response_format"  # (found by the worker's check)
    verdict = run_check("structural_tag", orjson.dumps(constraint.tag).decode(), "gbnf", "response_format", Bounds())
    assert verdict.problem is not None and "response_format.format.elements[0].pattern" in verdict.problem
    assert run_check("structural_tag", orjson.dumps(tag).decode(), "gbnf", "response_format", Bounds()).problem is None
    # a shape error anywhere is found before anything is parsed, on the event loop
    broken = {**tag, "format": {"type": "sequence", "elements": [*nodes, {"type": "regex", "pattern": 7}]}}
    with pytest.raises(ConstraintInvalid, match=r"elements\[100\]\.pattern must be a string"):
        extract({"response_format": broken})
    # and a small tag is checked whole where it is
    small = {**tag, "format": {"type": "sequence", "elements": [{"type": "regex", "pattern": "(?=x)"}]}}
    with pytest.raises(ConstraintInvalid, match=r"elements\[0\]\.pattern"):
        extract({"response_format": small})


def ladder(n: int) -> dict[str, Any]:
    """A schema of $defs each the allOf of two $refs to the next: about 2^(n+2) subschemas applied to one value."""
    defs: dict[str, Any] = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(n)}
    defs[f"d{n}"] = {"type": "object"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_a_schema_applying_exponentially_many_subschemas_to_one_value_is_refused() -> None:
    """The final sweep: a strict tool's parameters as a ladder of 17 such $defs (1.5 KB) held the event loop 5 s
    when a call's arguments were checked (2^18 evaluations of ``{}``; N = 25 would have been 20 minutes), and
    engines inline $refs the same way. Such a schema is refused wherever it comes: a json_schema constraint, a
    tool's parameters, a structural tag's schema; and an answer check whose values times the subschemas one of
    them may meet is over the budget is skipped, not run."""
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": ladder(10)}}
    tag = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": ladder(10)}}
    for body, param in (({"tools": [tool]}, "tools[0]"), ({"response_format": tag}, "response_format.format")):
        with pytest.raises(ConstraintInvalid, match="more than 1000 subschemas") as err:
            extract(body)
        assert err.value.code == "constraint_too_large" and err.value.param.startswith(param), err.value.param
    pending = extract({"json_schema": ladder(10)})  # (a larger schema: its whole check runs in a worker)
    assert pending is not None and pending.pending == "json_schema"
    verdict = run_check("json_schema", orjson.dumps(ladder(10)).decode(), "gbnf", "json_schema", Bounds())
    assert verdict.problem is not None and "more than 1000 subschemas" in verdict.problem
    fanned = ladder(7)  # (each value of an object meets the whole ladder again: ~510 subschemas)
    fanned["$defs"]["d7"] = {"type": "object", "additionalProperties": {"$ref": "#/$defs/d0"}}
    fine = extract({"tools": [{**tool, "function": {**tool["function"], "parameters": fanned}}]})
    assert fine is not None and fine.kind == "strict_tools"
    many = orjson.dumps({f"k{i}": {} for i in range(200)}).decode()  # 201 values x 510 subschemas: over the budget
    answer = orjson.dumps({"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": many}}]}}]})
    assert "subschemas" in unchecked("chat", answer, fine)
    wrong = orjson.dumps({"choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[]"}}]}}]})
    assert output_problem("chat", wrong, fine) is not None  # (a small answer is still checked)


def test_paths_are_written_out_only_where_a_message_needs_one() -> None:
    """The final sweep: a chain of 74 objects with 800-character keys over an array of 30,000 values (119 KB, within
    max_constraint_bytes) had a path string copied for every value: 1.6 GB held, 0.7 s, for one request. The walks
    now keep each path as a chain back to the root and write one out for a message only."""
    import tracemalloc

    node: dict[str, Any] = {"type": "x", "k": [0] * 30_000}
    for d in range(74):
        node = {"type": "x", f"K{d:02d}" + "a" * 800: node}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [node]}}
    schema: dict[str, Any] = {"type": "object", "enum": [[0] * 30_000]}
    for d in range(30):  # (two levels each: within max_nesting)
        schema = {"type": "object", "properties": {f"K{d:02d}" + "a" * 2000: schema}}
    tracemalloc.start()
    try:
        assert extract({"response_format": tag}) is not None
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        extract({"tools": [tool], "tool_choice": "auto"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 * 1024, f"{peak / 2**20:.0f} MiB"


def _ladder_defs(n: int, step: Callable[[int], dict[str, Any]], leaf: dict[str, Any]) -> dict[str, Any]:
    defs = {f"d{i}": step(i) for i in range(n)}
    defs[f"d{n}"] = leaf
    return defs


def test_an_answer_check_that_could_run_away_is_counted_before_it_runs_and_skipped() -> None:
    """The fifth sweep: the check of a strict tool's call (and of any answer under validate_outputs) ran
    jsonschema on the event loop, and two shapes within every request bound ran for minutes: ladders whose
    references the fan-out count did not follow ($anchor, $id, $dynamicRef, dependentSchemas, draft-7
    dependencies: 9.9 s at N = 19), and a counted ladder of 2^7 paths whose leaf applies it again to every child
    (the work multiplies along the answer's depth: never finished). The work is now counted before the check
    runs, and a check past the budget, or of a schema applying subschemas by rules the count does not follow,
    is skipped (the answer passes unchecked, as the docs say); an ordinary check still runs."""
    two = lambda ref: {"allOf": [{"$ref": ref}, {"$ref": ref}]}  # noqa: E731
    unfollowed = {
        "anchor": {"$defs": {k: {**v, "$anchor": k} for k, v in _ladder_defs(
            20, lambda i: two(f"#d{i + 1}"), {"type": "object"}).items()}, "$ref": "#d0"},
        "id": {"$id": "urn:root", "$defs": {k: {**v, "$id": f"urn:{k}"} for k, v in _ladder_defs(
            20, lambda i: two(f"urn:d{i + 1}"), {"type": "object"}).items()}, "$ref": "urn:d0"},
        "dependentSchemas": {"$defs": _ladder_defs(20, lambda i: {"dependentSchemas": {
            "a": {"$ref": f"#/$defs/d{i + 1}"}, "b": {"$ref": f"#/$defs/d{i + 1}"}}}, {"type": "object"}),
            "$ref": "#/$defs/d0"},
    }
    leaf = {"type": ["object", "array", "integer"], "additionalProperties": {"$ref": "#/$defs/d0"},
            "items": {"$ref": "#/$defs/d0"}}
    deep = {"$defs": _ladder_defs(7, lambda i: two(f"#/$defs/d{i + 1}"), leaf), "$ref": "#/$defs/d0"}
    cases = [*((schema, {"a": 1, "b": 2}) for schema in unfollowed.values()), (deep, {"x": [0] * 95})]
    for schema, answer in cases:
        constraint = Constraint("json_schema", "response_format", schema=schema)
        # (not checked: it would have run for seconds to hours)
        unchecked("completions", orjson.dumps({"choices": [{"text": orjson.dumps(answer).decode()}]}), constraint)
    ordinary = Constraint("json_schema", "response_format", schema={
        "$defs": {"n": {"type": "integer"}}, "type": "object",
        "properties": {"xs": {"type": "array", "items": {"$ref": "#/$defs/n"}}}})
    bad = orjson.dumps({"choices": [{"text": '{"xs": [1, 2, "three"]}'}]})
    assert output_problem("completions", bad, ordinary) is not None
    # uniqueItems over objects compares every pair (jsonschema sorts only what it can): 8,000 of them, 32M
    unique = Constraint("json_schema", "response_format", schema={"type": "array", "uniqueItems": True})
    objects = orjson.dumps([{"a": i} for i in range(8000)]).decode()
    unchecked("completions", orjson.dumps({"choices": [{"text": objects}]}), unique)
    numbers = orjson.dumps([*range(300), 0]).decode()  # (sorted: checked, and the duplicate found)
    assert output_problem("completions", orjson.dumps({"choices": [{"text": numbers}]}), unique) is not None


def _call(arguments: Any, calls: int = 1) -> bytes:
    tool_calls = [{"id": str(i), "type": "function", "function": {"name": "f", "arguments": orjson.dumps(
        arguments).decode()}} for i in range(calls)]
    return orjson.dumps({"choices": [{"message": {"role": "assistant", "tool_calls": tool_calls}}]})


def _strict(schema: dict[str, Any]) -> Constraint:
    return Constraint("strict_tools", "tools", schema={"f": schema})


def test_the_count_before_an_answer_check_covers_what_the_sixth_sweep_found() -> None:
    """The sixth sweep's shapes, each of which held the event loop 4-21 s or took gigabytes: uniqueItems over a
    list of mixed types (compared pairwise), draft 3's extends and schema-valued types (2^N, and a TypeError in
    jsonschema that was counted as the backend's failure), a tuple of k item schemas over k elements (the count
    itself built k^2 entries), 40 calls of one answer each within the budget, and a const the size of the answer
    compared 499 times. Each is now skipped within the answer's one budget; none raises."""
    ladder = lambda n, step, leaf: {**{f"d{i}": step(i) for i in range(n)}, f"d{n}": leaf}  # noqa: E731
    draft3 = "http://json-schema.org/draft-03/schema#"
    big = list(range(1000, 13_000))
    cases: list[tuple[dict[str, Any], Any, int]] = [
        ({"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}},
         {"x": ["s", *range(1000, 11_000)]}, 1),
        ({"$schema": draft3, "type": "object", "definitions": ladder(19, lambda i: {"extends": [
            {"$ref": f"#/definitions/d{i + 1}"}] * 2}, {"type": "object"}), "extends": {"$ref": "#/definitions/d0"}},
         {"a": 1}, 1),
        ({"$schema": draft3, "definitions": ladder(4, lambda i: {"type": [
            {"$ref": f"#/definitions/d{i + 1}"}] * 2}, {"type": "integer"}), "type": [{"$ref": "#/definitions/d0"}]},
         {"a": 1}, 1),
        ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
          "properties": {"x": {"type": "array", "items": [{} for _ in range(6000)]}}}, {"x": [0] * 6000}, 1),
        ({"type": "object", "$defs": {"i": {"type": "integer", "minimum": 0}},
          "properties": {"x": {"type": "array", "items": {"allOf": [{"$ref": "#/$defs/i"}] * 499}}}},
         {"x": [0] * 48}, 40),
        ({"type": "object", "$defs": {"c": {"const": big}}, "properties": {"x": {"allOf": [{"$ref": "#/$defs/c"}] *
                                                                                 499}}}, {"x": big}, 1),
    ]
    import tracemalloc

    for schema, arguments, calls in cases:
        tracemalloc.start()
        try:
            assert answer_verdict("chat", _call(arguments, calls), _strict(schema))[0] is None
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 * 1024 * 1024, (schema.get("$schema"), f"{peak / 2**20:.0f} MiB")
    # and what is small is still checked, calls and choices together
    small = {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}
    assert output_problem("chat", _call({"x": ["s", 1, 1]}), _strict(small)) is not None
    tuple_schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                    "properties": {"x": {"type": "array", "items": [{"type": "string"}]}}}
    assert output_problem("chat", _call({"x": [1]}), _strict(tuple_schema)) is not None
