"""The gateway's validators say what the engines they guard say: llama.cpp on GBNF (the verdicts below were
measured with llama-server 0.3.36, and are measured again when one is cached), llguidance on Lark, xgrammar
on EBNF lookaheads, and no automaton-based engine on the regex constructs it cannot enforce."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.sim.constrained import ebnf_sample, gbnf_sample
from gateway.structured import ConstraintInvalid, extract
from gateway.structured.bounds import Bounds
from gateway.structured.checks import run_check
from gateway.structured.syntax import ConstraintError, gbnf_to_ebnf, parse_grammar, validate_grammar, validate_regex
from gateway.structured.syntax.grammar_ast import Lit, Repeat
from gateway.structured.syntax.render import render_grammar

pytestmark = pytest.mark.unit

ABC = 'a ::= "a"\nb ::= "b"\nc ::= "c"\n'
LLAMA_ACCEPTS = [
    'root ::= [\\-a-z]+',  # an escaped '-' in a class
    'root ::= "\\-"',
    'root ::= "a"{2000}',
    'root ::= "a"{0,3000}',  # an upper bound past 2000 means "unbounded"
    'root ::= "a"{5}{400}',
    ABC + "root ::= (a b c){1000}",  # a, b, c were numbered before the group: it generates one rule
    'root ::= "a"\nroot ::= "b"',  # the last definition wins
    'root ::= foo\nroot ::= "b"',  # foo, only in the replaced definition, is numbered after the last rule
    'root ::= ("a"*)*',  # the group's one alternative is a reference: it cannot be passed over
    'root ::= ("a"?)*',
    'root ::= ("a"*)+',
    'root ::= "a"*{3}',
    'root ::= "a"?{2,5}',
    'root ::= x{1,3}\nx ::= "a" | ""',
    'root ::= ("a"?) root | "c"',  # left recursion llama.cpp does not see, and that stays bounded
    'root ::= x root | "c"\nx ::= y\ny ::= ""',
]
LLAMA_REJECTS = [
    ('root ::= "a"{2001}', "past llama.cpp's limit of 2000"),
    ('root ::= "a"{3000}', "past llama.cpp's limit of 2000"),
    ('root ::= ("a"*){2000}', "generates 2 rules, times 2000"),
    ('root ::= "a"{5}{500}', "generates 5 rules, times 500"),
    ("root ::= (a b c){1000}\n" + ABC, "generates 4 rules, times 1000"),
    ('root ::= ""*', "matches nothing at all"),
    ('root ::= "a"{0}*', "matches nothing at all"),
    ('root ::= ("")*', "the repetition '*' at line 1, column 14 reaches itself"),
    ('root ::= x*\nx ::= "a" | ""', "the repetition '*' at line 1, column 11 reaches itself"),
    ('root ::= "a"**', "the repetition '*' at line 1, column 14 reaches itself"),
    ('root ::= ()*', "left recursion"),
    ('root ::= "a"?{2,}', "left recursion"),
    ('root ::= x? root | "c"\nx ::= "a"', "left recursion is not supported by llama.cpp: root -> root"),
    ('root ::= "a"{0} root | "c"', "root -> root"),
    ('x ::= "a" | ""\nroot ::= "b"\nq ::= x*', "left recursion"),  # unreachable rules are checked too
    ('root ::= foo ("x")\nroot ::= "b"', "undefined rule 'foo'"),
    ('root ::= (foo)\nroot ::= "b"', "undefined rule 'foo'"),  # the replaced definition's group stays
    ('root ::= foo bar\nbar ::= "x"\nroot ::= "b"', "undefined rule 'foo'"),
    ('root ::= ("")*\nroot ::= "b"', "left recursion"),
]
LLAMA_HANGS = [  # llama.cpp accepts these, then never answers the request: the gateway refuses them
    'root ::= x root "b" | "c"\nx ::= y\ny ::= ""',
    'root ::= ("a"?) root "b" | "c"',
    'root ::= a "z" | "c"\na ::= ("a"?) root',
    'root ::= ("a"?) b "q"\nb ::= ("b"?) root | "c"',
]


@pytest.mark.parametrize("grammar", LLAMA_ACCEPTS)
def test_gbnf_that_llama_cpp_accepts_is_accepted(grammar: str) -> None:
    validate_grammar(grammar, "gbnf")
    gbnf_sample(grammar, random.Random(0))
    validate_grammar(gbnf_to_ebnf(grammar), "ebnf")


@pytest.mark.parametrize(("grammar", "words"), LLAMA_REJECTS)
def test_gbnf_that_llama_cpp_rejects_is_rejected(grammar: str, words: str) -> None:
    with pytest.raises(ConstraintError, match=words.replace("(", r"\(").replace("*", r"\*").replace("?", r"\?")):
        validate_grammar(grammar, "gbnf")


@pytest.mark.parametrize("grammar", LLAMA_HANGS)
def test_left_recursion_that_would_hang_llama_cpp_is_refused(grammar: str) -> None:
    with pytest.raises(ConstraintError, match="never finishes preparing"):
        validate_grammar(grammar, "gbnf")


def test_gbnf_reads_as_llama_cpp_reads_it() -> None:
    assert gbnf_sample('root ::= "a"\nroot ::= "b"', random.Random(0)) == "b"
    assert parse_grammar('root ::= "a"{0,3000}', "gbnf").rules["root"] == Repeat(Lit("a"), 0, None)
    assert set(gbnf_sample("root ::= [\\-a]{40}", random.Random(1))) == {"-", "a"}
    for digits in ("9" * 30, "9" * 5000):  # never a ValueError from int()
        with pytest.raises(ConstraintError, match="too large"):
            validate_grammar('root ::= "a"{' + digits + "}", "gbnf")


def test_a_repeat_of_a_repeat_is_counted_as_llama_cpp_counts_it() -> None:
    validate_grammar('root ::= ("a"*){1000}', "gbnf")
    with pytest.raises(ConstraintError, match="generates 2 rules, times 1001"):
        validate_grammar('root ::= ("a"*){0,1001}', "gbnf")


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    from gateway.llamacpp.build import binary_path
    from gateway.llamacpp.model import model_path
    from gateway.llamacpp.server import LlamaServer

    if not binary_path().exists():
        pytest.skip("no llama-server cached (gateway llamacpp build)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = LlamaServer(binary_path(), model_path("tiny"), port, slots=1, ctx=512).start()
    yield server.url
    server.stop()


@pytest.mark.system
def test_the_verdicts_are_llama_servers_own(llama_server: str) -> None:
    cases = [(g, True) for g in LLAMA_ACCEPTS] + [(g, False) for g, _ in LLAMA_REJECTS]
    with httpx.Client(base_url=llama_server, timeout=30) as client:
        found = {g: client.post("/completion", json={"prompt": "a", "n_predict": 1, "grammar": g}).status_code
                 for g, _ in cases}
    assert {g: code == 200 for g, code in found.items()} == dict(cases)


# -- Lark: llguidance ---------------------------------------------------------------------------------------
def nested(levels: int, open_: str = "(", close: str = ")") -> str:
    return "start: " + f'{open_}"a" ' * levels + close * levels


LARK_CASES = [
    (nested(28), True), (nested(29), False), (nested(28, "[", "]"), True), (nested(29, "[", "]"), False),
    ('start: "a"*?', False), ('start: "a"~2*', False), ('start: ("a"*)*', True), ('start: "a" ~ 2 .. 3', True),
    ('start: "a"{2147483647}', True), ('start: "a"{2147483648}', False), ('start: "a"~' + "9" * 5000, False),
    ("start: /" + "(" * 60 + "a" + ")" * 60 + "/", True),
]


@pytest.mark.parametrize(("grammar", "accepted"), LARK_CASES)
def test_lark_verdicts_are_llguidances(grammar: str, accepted: bool) -> None:
    try:
        validate_grammar(grammar, "lark", max_nesting=64)
        ours = True
    except ConstraintError:
        ours = False
    assert ours == accepted
    llguidance = pytest.importorskip("llguidance")
    failed, _ = llguidance.LLMatcher.validate_grammar_with_warnings(llguidance.grammar_from("lark", grammar))
    assert (not failed) == accepted


def test_lark_nested_past_llguidances_limit_is_the_clients_error_not_a_gateway_limit() -> None:
    with pytest.raises(ConstraintInvalid) as err:
        extract({"grammar": nested(29), "grammar_syntax": "lark"})
    assert err.value.code == "invalid_constraint" and "llguidance" in str(err.value)


# -- regexes: what no automaton can enforce -----------------------------------------------------------------
@pytest.mark.parametrize(("pattern", "words"), [
    (r"\bword\b", "word boundaries"), (r"a\Bb", "word boundaries"), (r"(?>a+)b", "atomic groups"),
    (r"a++", "possessive quantifiers"), (r"x(?:a{2,3}+)", "possessive quantifiers"), (r"(?=a)a", "lookahead"),
    (r"(a)(?(1)b|c)", "conditionals"),
])
def test_regex_constructs_no_automaton_can_enforce_are_refused(pattern: str, words: str) -> None:
    verdict = run_check("regex", pattern, "gbnf", "regex", Bounds())
    assert verdict.problem is not None and words in verdict.problem and "cannot be enforced" in verdict.problem
    with pytest.raises(ConstraintError, match=words.split()[0]):
        validate_regex(pattern)


@pytest.mark.parametrize("pattern", [r"\\1", r"[(?=]x", r"a+?b*?", r"\(?=\)"])
def test_regexes_that_only_look_like_them_are_accepted(pattern: str) -> None:
    assert run_check("regex", pattern, "gbnf", "regex", Bounds()).problem is None


# -- xgrammar EBNF: a rule may end with a lookahead assertion ------------------------------------------------
def test_an_ebnf_rule_may_end_with_a_lookahead_assertion() -> None:
    grammar = 'root ::= item "b"\nitem ::= "a"+ (= "b")\n'
    parsed = parse_grammar(grammar, "ebnf")
    assert parsed.lookaheads == {"item": Lit("b")}
    assert ebnf_sample(grammar, random.Random(0)).endswith("ab")
    assert render_grammar(parsed, "ebnf").splitlines()[1] == 'item ::= "a"+ (="b")'
    with pytest.raises(ConstraintError, match="cannot be written in GBNF"):
        render_grammar(parsed, "gbnf")
    verdict: Any = run_check("grammar", grammar, "ebnf", "ebnf", Bounds())
    assert verdict.problem is None and [d for d, _ in verdict.renderings] == ["ebnf"]  # never sent as GBNF


@pytest.mark.parametrize(("grammar", "words"), [
    ('root ::= ("a" (= "b"))', "may only end a rule"),
    ('root ::= "a" (= "b") "c"', "unexpected"),
    ('root ::= "a" (= missing)', "undefined rule 'missing'"),
    ('root ::= "a" (= "b"', "closing the lookahead"),
])
def test_a_misplaced_or_broken_lookahead_is_refused(grammar: str, words: str) -> None:
    with pytest.raises(ConstraintError, match=words):
        validate_grammar(grammar, "ebnf")


@pytest.mark.integration
@pytest.mark.parametrize(("grammar", "as_gbnf"), [
    ('root ::= "a" [0-9]+', True),
    ('root ::= "a"{0,3000}', False),  # llama.cpp: unbounded
    ('root ::= "\\x41B"', False),  # EBNF: one code point, U+041B; GBNF: "AB"
    ('root ::= "a" (= "b")', False),
])
def test_ebnf_goes_to_llama_cpp_only_when_it_reads_the_same_grammar(grammar: str, as_gbnf: bool) -> None:
    verdict = run_check("grammar", grammar, "ebnf", "ebnf", Bounds())
    assert verdict.problem is None
    assert [d for d, _ in verdict.renderings] == (["ebnf", "gbnf"] if as_gbnf else ["ebnf"])
