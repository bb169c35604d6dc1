"""The ways at once llama.cpp's grammar sampler follows a grammar's parse (gateway.structured.syntax.parses,
checks.schema_fanout): counted as llama.cpp counts its stacks, proved on llama.cpp's own example grammars; the
grammars, patterns and enums that froze llama-server are marked (Constraint.fanout) and never go to it."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from gateway.engines.registry import ENGINES
from gateway.structured import can_honour, extract, tools_fanout
from gateway.structured.bounds import Bounds
from gateway.structured.checks import run_check
from gateway.structured.syntax import gbnf_from_choices, parse_grammar, parse_regex
from gateway.structured.syntax.parses import MAX_PARSES, WORKER_BUDGET, _Compiled, most_parses
from gateway.structured.syntax.regex import expansion_problem, llama_parses
from tests.released.conftest import released
from tests.released.sources import LLAMA_CPP_GRAMMARS

pytestmark = pytest.mark.unit


BOUNDS = Bounds(max_nesting=64, max_bytes=1 << 20, max_rules=1000)


def fanout(body: dict[str, object]) -> str | None:
    """Why llama.cpp should not take the request's constraint (checked on the event loop or, past its budget,
    as a worker checks it), or None; a constraint that is not valid fails the test."""
    constraint = extract(body)
    assert constraint is not None
    if constraint.pending is None:
        return constraint.fanout
    payload = constraint.grammar if constraint.kind == "grammar" else orjson.dumps(constraint.schema)
    found = run_check(constraint.kind, payload, constraint.dialect, constraint.pending, BOUNDS)
    assert found.problem is None, found.problem
    return found.fanout


def parses(grammar: str) -> int:
    found = most_parses(parse_grammar(grammar, "gbnf"), 10**6, limit=10**6)  # (to the end: counting)
    assert found.complete
    return found.count


def alternatives_of_a(longest: int) -> str:
    return " | ".join('"' + "a" * k + '"' for k in range(1, longest + 1))


# sweep 22: 60 alternatives of a's under a repetition held ~1,800 stacks: 649 ms a token with a 128k vocabulary
SWEEP_22 = f"root ::= s+\ns ::= {alternatives_of_a(60)}\n"


@pytest.mark.parametrize(("grammar", "count"), [
    ('root ::= "yes" | "no"', 2),  # (one stack per alternative at the start)
    ('root ::= "a" | "ab" | "ac"', 3),  # (after "a": one done (the empty stack), two on)
    ("root ::= [a-z]+", 2),  # (after a letter: another, or the end)
    ('root ::= "x" [0-9]{3}', 1),
    ('root ::= ("a" | "b") ("c" | "d")', 2),
    # after "aaa": s starts again (its 4 alternatives, and the end) and every longer one is in at each offset
    # a split of the text leaves it (3 + 2 + 1): 11 (with 60 alternatives: 61 + 1,770, sweep 22's ~1,800)
    (f"root ::= s+\ns ::= {alternatives_of_a(4)}\n", 11),
])
def test_stacks_are_counted_as_llama_cpp_keeps_them(grammar: str, count: int) -> None:
    assert parses(grammar) == count


@pytest.mark.integration  # (the sdist is fetched from PyPI once per machine)
def test_llama_cpp_own_example_grammars_keep_few_stacks_and_pass() -> None:
    root = released(LLAMA_CPP_GRAMMARS) / "vendor" / "llama.cpp" / "grammars"
    grammars = sorted(root.glob("*.gbnf"))
    assert {p.name for p in grammars} >= {"json.gbnf", "c.gbnf", "arithmetic.gbnf", "chess.gbnf", "list.gbnf"}
    for path in grammars:
        text = Path(path).read_text()
        assert parses(text) <= 16, path.name  # (c.gbnf: 13, json.gbnf: 12)
        if path.name == "c.gbnf":  # (the one refused: see below)
            continue
        assert fanout({"grammar": text}) is None, path.name
    # c.gbnf's statement ends with an optional `else`, and the statement after it may begin with `e`: where one
    # nested level's part ends and the next one's begins may be either place, the shape of sweep 27's grammar whose
    # stacks grow with the depth it nested. Here they do not (the next level's `}` tells them apart: 5 stacks
    # after 1 or 80 ifs closed and "el"), but the check from the grammar alone cannot tell: kept from llama.cpp
    c_gbnf = (root / "c.gbnf").read_text()
    assert "may each end where the next one's may begin" in (fanout({"grammar": c_gbnf}) or "")


@pytest.mark.parametrize("grammar", [
    SWEEP_22,
    'root ::= ("x"{300} | "x")+\n',  # (one stack more at every character: 300 after 300)
    # (one more every 20 characters, 1,000 after 20,000: reaches 65 after ~1,300 characters)
    "root ::= (" + " ".join(['"x"{1999}'] * 10) + ' | "x"{20})+\n',
    'root ::= (("xy"){999} | "xyxyxyxyxy")+\n',  # (the same, two characters at a time)
    # sweep 24: a recursion through named rules behind a prefix longer than the search from the root (one request
    # took 49 s for 12 tokens and held another key's stream 34 s on a 128k vocabulary)
    'root ::= "' + "x" * 130 + '" t\nt ::= s u\nu ::= t | ""\ns ::= ' + alternatives_of_a(60) + "\n",
    # sweep 24: parts side by side behind a long beginning (1,001 stacks; another key's stream from 0.18 to 120 s)
    'root ::= "' + "x" * 130 + '" ' + " ".join(['"a"{0,40}'] * 25) + ' "a"{100}\n',
    # sweep 24: an unreferenced rule of 600 repetitions spent the search's budget first (the search skips what no
    # rule refers to, and an unfinished search keeps the grammar from llama.cpp anyway)
    'root ::= "' + "x" * 130 + '" t\nd ::= ' + " ".join(f'("{chr(97 + i % 26)}{i:05d}qwertyuiop")*' for i in range(600))
    + "\nt ::= s+\ns ::= " + alternatives_of_a(60) + "\n",
    f'root ::= "p"{{1900}} ({alternatives_of_a(12)})+\n',  # (deep in: 13 + 66 after 12 a's)
    "root ::= item+\nitem ::= " + " | ".join(f'"w{i:03d}"' for i in range(80)) + "\n",  # (80 begin alike)
    # sweep 26: a long beginning, then a choice whose first way is a recursion that comes round on itself (the
    # greediest text went in and never came out), then parts side by side: 962 stacks, 1,884 ms a token, another
    # key's 32 tokens took 171 s; and the same with 25 groups of 20 alternatives each (4,821 stacks)
    'root ::= "' + "x" * 60 + '" ("b" l)? "cdefg" ' + " ".join(['"a"{0,40}'] * 25) + ' "~"\nl ::= "q" l | ""\n',
    'root ::= "' + "x" * 60 + '" ("b" l)? "cdefg" ' + " ".join([f"({alternatives_of_a(20)})"] * 25)
    + ' "~"\nl ::= "q" l | ""\n',
    # a recursion entered from two places goes on differently from each: after "a(x)", s and t together hold 82
    # stacks, t alone (after "ax") 42; known by the recursion alone, "a(" was the set "b(" had been (searched first)
    'root ::= "a" r t | "b" r "z"\nr ::= "(" r ")" s | "x"\ns ::= "a"{0,40}\nt ::= "a"{0,40} "a"{0,40}\n',
])
def test_a_grammar_whose_parse_goes_too_many_ways_is_not_for_llamacpp(grammar: str) -> None:
    for body in ({"grammar": grammar}, {"ebnf": grammar}):  # (GBNF, or EBNF that is GBNF too)
        why = fanout(body)
        # (or, where the search ran out of its CPU time, as one did beside the rest of the suite in two processes:
        # kept from llama.cpp all the same)
        assert why is not None and (("ways at once" in why and f"more than {MAX_PARSES}" in why)
                                    or "could not follow within" in why), why
    assert fanout({"grammar": 'root ::= ("w" [0-9] [0-9] [0-9])+'}) is None


def test_a_recursion_whose_every_level_leaves_an_optional_part_is_not_for_llamacpp() -> None:
    """llama.cpp keeps a frame for what follows the reference at every level; once the innermost ends, each level's
    part that may match nothing may come next at once: one stack more per level, as deep as the text nests."""
    grammar = 'root ::= r\nr ::= "(" r s | "x"\ns ::= "a" | ""\n'
    compiled = _Compiled(parse_grammar(grammar, "gbnf"), 10**9)
    stacks = compiled.start("root")
    for character in "(" * 100 + "x":
        stacks = compiled.accept(stacks, ord(character))
    assert len(stacks) == 101
    why = fanout({"grammar": grammar})
    assert why is not None and "a recursion through rule 'r' whose every level may leave" in why, why
    for growing in ('root ::= r\nr ::= "(" r* | "x"\n', 'root ::= r\nr ::= "(" (r " "?) | "x"\n'):
        assert "a recursion through rule 'r'" in (fanout({"grammar": growing}) or ""), growing
    # sweep 27: each level's part may end where the next one's begins (p: 8 lengths of a's): after 300 a's, a b and
    # 100 a's the text splits between the levels 3,094 ways (6.8 s a token with a 128k vocabulary; another key's
    # 16-token requests from 0.12 to 100 s)
    unwinding = ('root ::= blk+\nblk ::= r "x"\nr ::= "a" r p | "b"\np ::= '
                 + " | ".join('"' + "a" * k + '"' for k in range(1, 9)) + "\n")
    compiled = _Compiled(parse_grammar(unwinding, "gbnf"), 10**9)
    stacks = compiled.start("root")
    for character in "a" * 300 + "b" + "a" * 100:
        stacks = compiled.accept(stacks, ord(character))
    assert len(stacks) > 1000
    for grammar in (unwinding, 'root ::= r\nr ::= "a" r [a-z]+ | "x"\n',
                    'root ::= r\nr ::= "a" r ("ab" | "abab") | "x"\n'):
        why = fanout({"grammar": grammar})
        assert why is not None and "may each end where the next one's may begin" in why, (grammar, why)
    # (what must match after the reference ends the chain of levels; a reference in last place keeps no frame)
    for bounded in ('root ::= r\nr ::= "(" r ")" s | "x"\ns ::= "a"?\n', 'root ::= r\nr ::= "(" r | "x"\n',
                    'root ::= r\nr ::= "a" r ("a" | "b") | "x"\n', 'root ::= r\nr ::= "(" r ")" [ ]* | "x"\n',
                    'root ::= r ("," r)*\nr ::= "[" (r ("," r)*)? "]" | "x"\n'):
        assert fanout({"grammar": bounded}) is None, bounded


def test_the_check_of_a_long_ring_of_rules_is_linear_in_them() -> None:
    """Evaluated rule by rule in the file's order, 1,900 rules each referring to the next took 1,900 rounds of the
    whole grammar (116 s for a 127 KB grammar): rules are evaluated callees first, again only when one they refer
    to changed, within a bound of steps (past it the grammar is kept from llama.cpp, saying so)."""
    from gateway.structured.syntax.parses import nesting_problem

    rules = [f'r{i} ::= "k{i}" r{i + 1} [a-z]* ")"' for i in range(1, 1900)]
    ring = parse_grammar("root ::= r1\n" + "\n".join(rules) + '\nr1900 ::= "(" r1 ")" | "z"\n', "gbnf",
                         max_rules=5000)
    assert nesting_problem(ring) is None  # (within the bound: a ")" ends each level)


def test_the_check_of_recursions_is_bounded_on_the_event_loop_and_in_a_worker() -> None:
    """Sweep 28: a 1 KB grammar whose recursion's parts hold hundreds of separate characters took nesting_problem 4 s
    on the event loop (one step sorted ~100,000 ranges): each range it holds is a step now, and past the loop's
    share the check goes to a worker; past the worker's, the grammar is kept from llama.cpp."""
    from gateway.structured.syntax.parses import NESTING_INLINE, Unfollowed, nesting_problem

    spaced = "".join(chr(0x100 + 2 * i) for i in range(300))  # (300 ranges of one character each)
    grammar = f'root ::= r\nr ::= "x" | [{spaced}] r [{spaced}]* "y"\n'
    with pytest.raises(Unfollowed):
        nesting_problem(parse_grammar(grammar, "gbnf"), NESTING_INLINE)
    constraint = extract({"grammar": grammar})
    assert constraint is not None and constraint.pending == "grammar"  # (for a worker)
    assert nesting_problem(parse_grammar(grammar, "gbnf")) is None  # (in the worker: its verdict, within its steps)


@pytest.mark.integration
def test_what_the_event_loop_cannot_finish_goes_to_a_worker() -> None:
    root = released(LLAMA_CPP_GRAMMARS) / "vendor" / "llama.cpp" / "grammars"
    json_gbnf = (root / "json.gbnf").read_text()
    assert len(json_gbnf) <= 1024  # (checked inline by size; its search is larger than the inline budget)
    constraint = extract({"grammar": json_gbnf})
    assert constraint is not None and constraint.pending == "grammar"


def test_a_pattern_enum_or_union_that_goes_too_many_ways_is_not_for_llamacpp() -> None:
    pattern = "^(" + "|".join("a" * k for k in range(1, 21)) + ")+$"
    # (the structural measure of nested repetitions passes it: each alternative is of fixed length)
    assert expansion_problem(parse_regex(pattern)) is None
    found = llama_parses(parse_regex(pattern), WORKER_BUDGET)
    assert found is not None and found.count > MAX_PARSES
    why = fanout({"json_schema": {"type": "string", "pattern": pattern}})
    assert why is not None and "the pattern at /pattern" in why, why
    ids = [f"customer-{i:04d}" for i in range(1000)]  # (1,000 stacks through "customer-": ~10,000 in all)
    why = fanout({"json_schema": {"type": "object", "properties": {"id": {"enum": ids}}}})
    assert why is not None and "the enum at /properties/id has 1000 values that begin alike" in why, why
    # sweep 24: optional properties are a choice of the next one among all that may come, as an enum's values
    alike = {f"{'customer_account_settings_preference_of_':s}{i:04d}": {"type": "integer"} for i in range(200)}
    why = fanout({"json_schema": {"type": "object", "properties": alike}})
    assert why is not None and "the object at / has 200 optional properties whose names begin alike" in why, why
    assert fanout({"json_schema": {"type": "object", "properties": alike, "required": list(alike)}}) is None
    # sweep 25: an anyOf of 30 anyOfs of 30 consts that begin alike (each union 30, no enum)
    nested = {"anyOf": [{"anyOf": [{"const": f"customer-account-reference-identifier-{o:03d}{i:03d}"}
                                   for i in range(30)]} for o in range(30)]}
    assert f"anyOf at / has {MAX_PARSES + 1} alternatives (through the unions and enums in it)" in (
        fanout({"json_schema": nested}) or "")
    union = {"anyOf": [{"type": "object", "properties": {"k": {"const": i}}} for i in range(MAX_PARSES + 1)]}
    assert f"anyOf at / has {MAX_PARSES + 1} alternatives" in (fanout({"json_schema": union}) or "")
    # (and a grammar's alternatives are each searched: a decoy of 40 short ones beside a plain one that piles up
    # 962 drew the search away, sweep 25; 30 here, under the bound)
    trap = ('root ::= "' + "x" * 40 + '" ("y" ' + " ".join(['"a"{0,40}'] * 25) + ' | "z" ('
            + " | ".join(f'"q{i:02d}"' for i in range(30)) + "))")
    why = fanout({"grammar": trap}) or ""
    assert "xxxya" in why and f"more than {MAX_PARSES}" in why, why  # (the plain branch's, past the decoy)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}}}]
    constraint = extract({"tools": tools, "tool_choice": "required"})
    assert constraint is not None and "tools[0].function.parameters" in (constraint.fanout or "")
    assert extract({"tools": tools}) is None and tools_fanout(tools) is not None  # (llama.cpp's lazy grammar)
    # (its tool-call grammar is a choice of the tool, each alternative its name: names that begin alike count as an
    # enum's values do; 64 tools of distinct names do not)
    alike = [{"type": "function", "function": {"name": f"get_customer_account_record_{i:03d}"}} for i in range(200)]
    assert "200 tool names that begin alike" in (tools_fanout(alike) or "")
    distinct = [{"type": "function", "function": {"name": f"{chr(97 + i % 26)}{i}_tool"}} for i in range(64)]
    assert tools_fanout(distinct) is None
    # sweep 24: decoy patterns placed first spent the schema's budget, and the pattern after them went unsearched
    decoy = "^(" + "|".join("a" * k + "b" for k in range(1, 41)) + ")+$"  # (40 lengths: under the static bound)
    for order in (1, -1):
        properties = [("v", {"type": "string", "pattern": pattern}),
                      *((f"d{i}", {"type": "string", "pattern": decoy}) for i in range(5))][::order]
        assert fanout({"json_schema": {"type": "object", "properties": dict(properties)}}) is not None
    # what real schemas hold: 250 country names (~520 stacks through a value at most), a union of 64, an id pattern
    countries = [f"{chr(65 + i % 26)}{chr(97 + i // 26)}land" for i in range(250)]
    assert fanout({"json_schema": {"type": "object", "properties": {"country": {"enum": countries}}}}) is None
    # (but not an array of them: 250 ways at each item's start, sweep 30)
    assert fanout({"json_schema": {"type": "array", "items": {"enum": countries}}}) is not None
    assert fanout({"json_schema": {"anyOf": union["anyOf"][:MAX_PARSES]}}) is None
    assert fanout({"json_schema": {"type": "string", "pattern": "^[a-z]+(,[a-z]+)*$"}}) is None


def test_a_schemas_unions_enums_and_optional_properties_are_counted_together() -> None:
    """Sweep 27: each counted alone, an anyOf of 64 objects each with a 450-value enum (through a $ref) passed, and
    llama.cpp held 28,800 stacks (19.6 s a token with a 128k vocabulary; another key's p50 from 0.12 to 12.9 s);
    so did 30 objects of 300 optional properties, and unions of unions of such enums. (Since sweep 30 an enum
    a $ref may use, and optional names and enums written once that add up, are held first.)"""
    values = [f"{chr(0x100 + i)}" for i in range(450)]
    product = {"$defs": {"e": {"enum": values}},
               "anyOf": [{"type": "object", "properties": {"a": {"$ref": "#/$defs/e"}}, "required": ["a"]}
                         for _ in range(32)]}  # (64 of them are 64 alternatives, past the union's own bound now)
    assert _held(fanout({"json_schema": product}))
    optional = {"anyOf": [{"type": "object", "properties": {f"p{i:03d}": {"type": "integer"} for i in range(100)}}
                          for _ in range(30)]}  # (sweep 27's: 300 properties, 88 KB)
    assert _held(fanout({"json_schema": optional}))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": product["$defs"], "properties": {"x": {"anyOf": product["anyOf"]}}}}}]
    assert _held(tools_fanout(tools))
    # sweep 28: the same union as a draft-07 tuple's item, and a union of strings each with a 47-way pattern
    tuple_items = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"e": {"enum": values}},
                   "type": "array", "items": [{"anyOf": [{"type": "object", "properties": {
                       "a": {"$ref": "#/definitions/e"}}, "required": ["a"]} for _ in range(32)]}]}
    assert _held(fanout({"json_schema": tuple_items}))
    pattern = "^(" + "|".join("a" * k for k in range(1, 8)) + ")*$"
    strings = {"anyOf": [{"type": "string", "pattern": pattern}] * 32}
    patterned = {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {"a": strings},
                                                        "required": ["a"]}] * 32}}
    assert "together may hold 23,552 ways at once" in (fanout({"json_schema": patterned}) or "")
    assert fanout({"json_schema": {"type": "array", "items": {"type": "string", "pattern": pattern}}}) is None
    # an allOf's anyOf parts: llama.cpp merges their properties as optional, whatever they require
    names = {f"customer_record_field_{i:04d}": {} for i in range(300)}
    merged = {"allOf": [{"anyOf": [{"type": "object", "properties": names, "required": list(names)}]}]}
    assert "merges as optional" in (fanout({"json_schema": merged}) or "")
    required = {"allOf": [{"type": "object", "properties": names, "required": list(names)}]}
    assert fanout({"json_schema": required}) is None
    # what real schemas hold passes: one such enum, a union of a few objects with a few properties each
    assert fanout({"json_schema": {"type": "object", "properties": {"a": {"enum": values}}}}) is None
    few = {"anyOf": [{"type": "object", "properties": {"kind": {"const": k}, "n": {"type": "integer"}},
                      "required": ["kind"]} for k in ("a", "b", "c")]}
    assert fanout({"json_schema": few}) is None


def test_an_ebnf_grammar_too_ambiguous_for_llamacpp_goes_to_the_other_engines() -> None:
    ambiguous = f"root ::= s+\ns ::= {alternatives_of_a(20)}\n"  # (small enough for the event loop)
    constraint = extract({"ebnf": ambiguous})
    assert constraint is not None and constraint.pending is None and constraint.fanout is not None
    able = {name for name, spec in ENGINES.items() if can_honour(constraint, spec.structured) and spec.many_parses}
    assert "llamacpp" not in able and {"vllm", "sglang"} <= able
    plain = extract({"ebnf": 'root ::= "a" [b-z]*'})
    assert plain is not None and plain.fanout is None and [d for d, _ in plain.renderings] == ["ebnf", "gbnf"]


def test_choices_that_part_many_ways_at_once_are_not_for_llamacpp() -> None:
    """Sweep 25: 10,000 one-character choices (30 KB) are a tree of 10,000 branches at its root: one 4-token
    request held llama-server 11.8 s with a 128k vocabulary."""
    many = [chr(0x4E00 + i) for i in range(10_000)]
    for field in ("choice", "guided_choice"):
        constraint = extract({field: many})
        assert constraint is not None and "part 10000 ways at once" in (constraint.fanout or ""), constraint
    ids = extract({"choice": [f"customer-{i:04d}" for i in range(500)]})
    assert ids is not None and ids.fanout is None


def test_choices_that_begin_alike_are_one_parse_on_llama_cpp() -> None:
    choices = [f"customer-{i:04d}" for i in range(500)] + ["custom", "cust", ""]
    grammar = gbnf_from_choices(choices)
    flat = "root ::= " + " | ".join(f'"{c}"' for c in choices)
    assert parses(flat) == len(choices)
    assert parses(grammar) <= 11  # (the ten digits and the end, at most, where the choices part)


def test_a_grammar_the_search_cannot_follow_to_its_end_is_not_for_llamacpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unfinished search is no verdict: decoys placed first could spend the budget before the rule that fans
    out is reached. On the event loop it goes to a worker; there, past the worker's budget, it is kept from
    llama.cpp (llama.cpp's own example grammars take at most ~92,000 of the 200,000: c.gbnf)."""
    from gateway.structured import checks

    grammar = 'root ::= ("a" [b-d]* ("," [0-9]+)?)+ t\nt ::= "x" t | "y"\n'
    assert fanout({"grammar": grammar}) is None
    # (one stack more every 200 characters, 33 only after ~6,600: past the search's budget, so not for llama.cpp)
    slow = "root ::= (" + " ".join(['"x"{1999}'] * 10) + ' | "x"{200})+\n'
    assert "could not follow within 200,000 steps" in (fanout({"grammar": slow}) or "")
    monkeypatch.setattr(checks, "WORKER_BUDGET", 50)
    found = run_check("grammar", grammar, "gbnf", "grammar", BOUNDS)
    assert found.problem is None and found.fanout is not None and "could not follow within 50 steps" in found.fanout


def test_an_enum_or_optional_properties_that_may_be_written_again_and_again_are_held_to_ways_at_once() -> None:
    """Sweep 30: at the start of an enum's value every value is a stack, so 480 two-letter codes cost llama.cpp
    200 ms a token against 2.5 plain (a 128k vocabulary), all different from the first letter on (their summed cost,
    987, passed MAX_ENUM_COST); in an array of 60 items, 60 such tokens and more, another key's p50 0.09 -> 30 s."""
    codes = [a + b for a in "abcdefghijklmnopqrs" for b in "abcdefghijklmnopqrstuvwxyz"][:480]
    array = {"type": "object", "properties": {"v": {"type": "array", "items": {"enum": codes}, "minItems": 60}}}
    why = fanout({"json_schema": array})
    assert why is not None and "the enum at /properties/v/items has 480 values and may be written many times" in why
    assert "more than 32" in why
    assert fanout({"json_schema": {**array, "properties": {"v": {"type": "array", "items": {
        "enum": codes[:MAX_PARSES]}}}}}) is None, "32 ways at once pass"
    # in a definition a $ref may use from anywhere, or in an open object's values: as in an array
    defs = {"$defs": {"code": {"enum": codes[:100]}}, "type": "object", "properties": {"c": {"$ref": "#/$defs/code"}}}
    assert "may be written many times" in (fanout({"json_schema": defs}) or "")
    open_object = {"type": "object", "additionalProperties": {"enum": codes[:100]}}
    assert "may be written many times" in (fanout({"json_schema": open_object}) or "")
    # written once: a few slow tokens; one country list passes, but not so many of them that they add up
    countries = codes[:249]
    once = {"type": "object", "properties": {"country": {"enum": countries}}}
    assert fanout({"json_schema": once}) is None
    five = {"type": "object", "properties": {f"c{i}": {"enum": countries} for i in range(5)}}
    assert "hold 1250 values in all" in (fanout({"json_schema": five}) or "")
    # an object's optional properties are a choice of the next among all that may come: in an array, 32 at most
    names = {f"field_{i}": {"type": "integer"} for i in range(40)}
    rows = {"type": "array", "items": {"type": "object", "properties": names}}
    assert "has 40 optional properties and may be written many times" in (fanout({"json_schema": rows}) or "")
    assert fanout({"json_schema": {"type": "object", "properties": names}}) is None, "written once"


def _held(why: str | None) -> bool:
    """Whether a schema was kept from llama.cpp for the ways it would follow at once (its unions, enums and optional
    properties together, or one of them written again and again, or all written once together)."""
    return why is not None and any(said in why for said in ("together may hold", "may be written many times",
                                                             "values in all"))
