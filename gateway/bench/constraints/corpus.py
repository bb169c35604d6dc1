"""The benchmark's inputs: GBNF, xgrammar EBNF, Lark, regex and JSON-schema constraints, valid, invalid and
adversarial, each with what the engines' own parsers say about it where that is known (``expect``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Case:
    """One input. ``expect``: what the real engines' parsers say where known (None: unknown or engine-specific);
    ``adversarial`` cases are also timed with the limits lifted; ``stack_kib`` runs the call in a thread
    with that much stack."""

    id: str
    cls: str
    kind: str  # grammar | regex | json_schema
    dialect: str  # gbnf | ebnf | lark for grammars; the kind otherwise
    text: str
    expect: str | None = None
    why: str = ""
    adversarial: bool = False
    stack_kib: int | None = None


def _chain(rules: int, arrow: str = "::=", root: str = "root") -> str:
    """Each rule refers to the next (the grammar that froze the gateway for 42 s at 12,000 rules)."""
    lines = [f"{root} {arrow} r1"] + [f'r{i} {arrow} "a" r{i + 1}' for i in range(1, rules)]
    return "\n".join([*lines, f'r{rules} {arrow} "a"']) + "\n"


def _long_grammar(rules: int, last: str) -> str:
    lines = ["root ::= r1"] + [f'r{i} ::= "word-{i}" [a-z]* ("," [0-9]+)? r{i + 1}' for i in range(1, rules)]
    return "\n".join([*lines, f'r{rules} ::= "end" {last}', 'end ::= "."']) + "\n"


def _deep_schema(levels: int) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt/] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""
LARK_JSON = r"""
?start: value
?value: object | array | string | JSON_NUMBER -> number | "true" -> true | "false" -> false | "null" -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
JSON_NUMBER: /-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/
%import common.ESCAPED_STRING
%import common.WS
%ignore WS
"""
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["name", "age"],
    "additionalProperties": False}
A, R = "accept", "reject"
LLAMA = "llama.cpp llama-grammar.cpp"
LARK_AUTHORITY = ("llguidance: the Lark parser of TabbyAPI and of vLLM's guidance backend (vLLM's xgrammar path "
                  "converts Lark itself)")


def _gbnf() -> list[Case]:
    ok = {  # tests/sim/test_constrained.py, tests/structured, tests/api
        "yes-no": 'root ::= "yes" | "no"', "json": JSON_GBNF, "api": 'root ::= ("yes" | "no") " " [0-9] [0-9]',
        "arith": 'root ::= expr\nexpr ::= term (space-op term)*\nterm ::= num | "(" expr ")" | "-" term\n'
                 'space-op ::= " "? [-+*/] " "?\nnum ::= [0-9]+ ("." [0-9]+)?\n',
        "features": 'root ::= g " " rep " " [a-c] [^a-z\\n] [\\x41-\\x43] " " "\\x41\\"\\\\\\t" .\n'
                    'g ::= "hi" | "hello"\nrep ::= "ab"{2} "c"{1,} "d"{0,2} "e"{3,4}\n',
        "digit-name": 'root ::= 9lives\n9lives ::= "nine"', "comment": '# c\nroot ::= "a" # trailing\n',
    }
    cases = [Case(f"gbnf/{k}", "gbnf", "grammar", "gbnf", v, A) for k, v in ok.items()]
    cases += [Case("gbnf/lazy-repeat", "gbnf", "grammar", "gbnf", 'root ::= "a"*?', A, f"{LLAMA}: ? after *"),
              Case("gbnf/escaped-dash", "gbnf", "grammar", "gbnf", 'root ::= [\\-a-z]+', A, f"{LLAMA}: \\- escape"),
              Case("gbnf/u-escape", "gbnf", "grammar", "gbnf", 'root ::= "\\u00e9"', A, f"{LLAMA}: \\uXXXX"),
              Case("gbnf/no-finite-derivation", "gbnf", "grammar", "gbnf", 'root ::= a\na ::= "x" a', A,
                   "llama.cpp parses it; no output can ever end (the gateway refuses it)"),
              Case("gbnf/repeat-3000", "gbnf", "grammar", "gbnf", 'root ::= "a"{3000}', R,
                   f"{LLAMA}: MAX_REPETITION_THRESHOLD 2000"),
              Case("gbnf/duplicate-rule", "gbnf", "grammar", "gbnf", 'root ::= "a"\nroot ::= "b"', None,
                   "llama.cpp keeps the last definition")]
    nullable = {"star-star": ('root ::= "a"**', R), "empty-star": ('root ::= ("")*', R),
                "nullable-star": ('root ::= x*\nx ::= "a" | ""', R), "star-of-star": ('root ::= ("a"*)*', A),
                "opt-star": ('root ::= ("a"?)*', A)}
    cases += [Case(f"gbnf/{k}", "gbnf", "grammar", "gbnf", v, e, f"{LLAMA}: x* is the rule x' ::= x x' |, left "
                   "recursive when x has an empty alternative") for k, (v, e) in nullable.items()]
    compiled = {  # what llama.cpp's compiler refuses beyond the syntax (gateway/structured/syntax/gbnf_llama.py)
        "repeat-product": ('root ::= ("a"*){2000}', R, "rules generated times the count past 2000"),
        "repeat-nothing": ('root ::= ""*', R, "'expecting preceding item'"),
        "upper-past-2000": ('root ::= "a"{0,3000}', A, "an upper bound past 2000 means unbounded"),
        "huge-count": ('root ::= "a"{' + "9" * 30 + "}", R, "std::stoull out of range"),
        "replaced-undefined": ('root ::= (foo)\nroot ::= "b"', R, "the replaced definition's group stays"),
        "hidden-left-tail": ('root ::= ("a"?) root | "c"', A, "a group with no empty alternative is not skipped"),
        "hidden-left-hang": ('root ::= x root "b" | "c"\nx ::= y\ny ::= ""', R,
                             "accepted, then the request never ends: the gateway refuses it"),
    }
    cases += [Case(f"gbnf/{k}", "gbnf", "grammar", "gbnf", v, e, f"{LLAMA}: {why}")
              for k, (v, e, why) in compiled.items()]
    bad = {"open-group": 'root ::= "a" (', "stray-paren": 'root ::= "a"\nnext ::= "b" )',
           "unterminated": 'root ::= "unterminated', "open-class": "root ::= [a-", "unknown-escape": 'root ::= "\\q"',
           "short-hex": 'root ::= "\\x4"', "reversed-repeat": 'root ::= "a"{3,1}', "repeat-no-min": 'root ::= "a"{,3}',
           "equals": 'root = "a"', "undefined": "root ::= foo", "no-root": 'x ::= "a"',
           "left-recursion": 'root ::= root "a" | "a"', "indirect-left": 'root ::= b "a" | "a"\nb ::= "" | root',
           "token-ref": "root ::= <think>", "underscore": 'under_score ::= "a"\nroot ::= under_score'}
    cases += [Case(f"gbnf/{k}", "gbnf", "grammar", "gbnf", v, R) for k, v in bad.items()]
    adv = {"chain-500": (_chain(500), A), "chain-1999": (_chain(1999), A), "chain-2500": (_chain(2500), A),
           "chain-3000": (_chain(3000), A), "chain-12000": (_chain(12_000), A),
           "long-1900-undefined": (_long_grammar(1900, "undefined-3"), R),
           "nest-64": ("root ::= " + '("a" ' * 64 + ")" * 64, A),
           "nest-100": ("root ::= " + '("a" ' * 100 + ")" * 100, A),
           "nest-2000": ("root ::= " + '("a" ' * 2000 + ")" * 2000, A), "stars-100": ('root ::= "a"' + "*" * 100, A),
           "alternation-12000": ("root ::= " + " | ".join(f'"w{i}"' for i in range(12_000)), A),
           "alt-rep-30": ("root ::= " + '("a" | "b" (' * 30 + '"c"' + ")*)*" * 30, A)}
    cases += [Case(f"gbnf/{k}", "gbnf-adversarial", "grammar", "gbnf", v, e, adversarial=True)
              for k, (v, e) in adv.items()]
    return cases


def _ebnf() -> list[Case]:
    x = "xgrammar EBNF docs"
    ok = {"literal": 'root ::= "a"', "as-gbnf": 'root ::= "a" [0-9]', "regex-macro": 'root ::= Regex("[a-z]+")',
          "left-recursion": 'root ::= root "a" | "a"',
          "dialect": 'root ::= item ("," item){0,3} tail\n'
                     'item[capture] ::= [a-zA-Z_] [a-zA-Z0-9_]* | "\\x1F600" | num\n'
                     'num ::= Regex("[0-9]{2}-[0-9]{2}")\ntail ::= "" | "\\e" | [\\-\\]] | [^]\n'}
    bad = {"lookahead": 'root ::= "a" (= "b")', "tag-dispatch": 'root ::= TagDispatch(("<t>", r))\nr ::= "x"',
           "double-repeat": 'root ::= "a"++', "lookahead-inside": 'root ::= ("a" (= "b"))',
           "raw-newline": 'root ::= "a\nb"', "shorthand": "root ::= [\\d]",
           "lazy": 'root[lazy] ::= "a"', "bad-regex": 'root ::= Regex("(")', "undefined": "root ::= missing"}
    cases = [Case(f"ebnf/{k}", "ebnf", "grammar", "ebnf", v, A, x) for k, v in ok.items()]
    cases[-1] = Case(cases[-1].id, "ebnf", "grammar", "ebnf", cases[-1].text, None, "xgrammar-specific escapes")
    cases += [Case(f"ebnf/{k}", "ebnf", "grammar", "ebnf", v, A if k == "lookahead" else R, x)
              for k, v in bad.items()]  # xgrammar's grammar_parser.cc: a rule may end with a (= ...) lookahead
    cases.append(Case("ebnf/regex-nest-100", "ebnf", "grammar", "ebnf",
                      'root ::= Regex("' + "(" * 100 + "a" + ")" * 100 + '")', None, x, adversarial=True))
    return cases


def _lark() -> list[Case]:
    eng = LARK_AUTHORITY
    ok = {"json": LARK_JSON, "yes-no": 'start: "a" | "b"',
          "api": 'start: ("yes" | "no") " " DIGIT\n%import common.DIGIT',
          "features": 'start: greeting _SEP name ("!" ~ 2..3) code? list\ngreeting: "hello"i | "hi"\n_SEP: " "\n'
                      'name: WORD | CNAME\ncode: /[A-Z]{2}\\d+/ | LETTER ~ 2\nlist: "[" [INT ("," INT)*] "]"\n'
                      "%import common (WORD, CNAME, INT, LETTER)\n// comments are fine\n",
          "signed-number": "start: SIGNED_NUMBER\n%import common.SIGNED_NUMBER\n"}
    cases = [Case(f"lark/{k}", "lark", "grammar", "lark", v, A) for k, v in ok.items()]
    bad = {"no-start": ('begin: "a"', R), "undefined": ("start: missing", R), "open-group": ('start: "a" (', R),
           "terminal-to-rule": ('start: A\nA: b\nb: "x"', R),
           "unknown-common": ("start: X\n%import common.NOPE -> X", R),
           "other-import": ("start: X\n%import other.X", R), "declare": ("start: X\n%declare X", None),
           "template": ("start: _sep{a}\n_sep{x}: x", None), "lookahead": ("start: /(?=a)a/", R),
           "no-finite-derivation": ('start: "a" start', None), "reversed-range": ('start: "b".."a"', R),
           "stacked-ops": ('start: "a"*?', R)}
    cases += [Case(f"lark/{k}", "lark", "grammar", "lark", v, e, eng) for k, (v, e) in bad.items()]
    adv = {"chain-500": _chain(500, ":", "start"), "chain-1999": _chain(1999, ":", "start"),
           "chain-3000": _chain(3000, ":", "start"),
           "nest-20": "start: " + '["a" ' * 20 + "]" * 20, "nest-28": "start: " + '["a" ' * 28 + "]" * 28,
           "nest-29": "start: " + '["a" ' * 29 + "]" * 29, "nest-64": "start: " + '["a" ' * 64 + "]" * 64,
           "nest-100": "start: " + '("a" ' * 100 + ")" * 100,
           "regex-nest-100": "start: /" + "(" * 100 + "a" + ")" * 100 + "/",
           "alternation-10000": "start: " + " | ".join(f'"w{i}"' for i in range(10_000)),
           "terminal-chain-1999": "\n".join(["start: T1", *(f'T{i}: "a" T{i + 1}' for i in range(1, 1999)),
                                             'T1999: "a"'])}
    cases += [Case(f"lark/{k}", "lark-adversarial", "grammar", "lark", v, None, eng, adversarial=True)
              for k, v in adv.items()]
    return cases


def _regex() -> list[Case]:
    ok = [r"\d{3}-\d{4}", r"[A-Z][a-z]+ (?:[a-z]+ )*end\.", r"^(ab|cd)+$", r"[^a-z]{2,5}", r".*",
          r"\w+@\w+\.(com|org)", r"(?i)hello [^x]", r"[\D][\W][\S]", r"(?P<year>\d{4})-(?:0[1-9]|1[0-2])",
          r"a{2}b{1,}c{0,3}d??e*?f+?", r"(?:yes|no|maybe)", r"\\\.\*\(\)\[\]", r"\t\n[\u00e9-\u00ff]", r"x|",
          r"(a|b(c|d(e|f)))+", "[0-9]+", "[A-Z][a-z]{2,6}-[0-9]{3}"]
    cases = [Case(f"regex/{i}", "regex", "regex", "regex", p, A) for i, p in enumerate(ok)]
    bad = {"backref": r"(a)\1", "lookahead": r"a(?=b)", "lookbehind": r"(?<!a)b", "word-boundary": r"\bword\b",
           "atomic": r"(?>a+)", "unclosed": "(unclosed", "reversed-repeat": r"a{2,1}", "reversed-range": r"[z-a]",
           "lookahead-start": "(?=a)b"}
    cases += [Case(f"regex/{k}", "regex", "regex", "regex", v, R, "automaton engines (xgrammar, llguidance)")
              for k, v in bad.items()]
    cases.append(Case("regex/empty", "regex", "regex", "regex", "", None, "the empty language's regex"))
    cases.append(Case("regex/possessive", "regex", "regex", "regex", "a++b", None,
                      "llguidance reads it as a+b; Python's possessive a++ never gives back (no match): the gateway "
                      "refuses it"))
    cases += [Case(f"regex/lookalike-{i}", "regex", "regex", "regex", p, A, "no backreference, no lookahead")
              for i, p in enumerate((r"\\1", r"[(?=]x"))]
    words = "|".join(f"word{i}" for i in range(10_000))
    adv = {"nest-5000": ("(" * 5000 + "a" + ")" * 5000, None), "nest-64": ("(" * 64 + "a" + ")" * 64, A),
           "alternation-300": ("(ab|cd)" * 300, A), "groups-then-nest": ("()" * 3000 + "(" * 100 + ")" * 100, A),
           "star-star": ("(a*)*b", A), "alt-overlap": ("(a|aa)*c", A), "plus-plus": ("(x+x+)+y", A),
           "counted-100x100": ("(?:a{0,100}){0,100}", A), "counted-1000x1000": ("(a{1000}){1000}", None),
           "dfa-blowup": ("(.*a){20}", A), "words-10000": (f"(?:{words})", A)}
    cases += [Case(f"regex/{k}", "regex-adversarial", "regex", "regex", v, e, adversarial=True)
              for k, (v, e) in adv.items()]
    return cases


def _json() -> list[Case]:
    ok: dict[str, Any] = {
        "object": {"type": "object"}, "empty": {}, "person": PERSON,
        "tree": {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"}, "children": {
            "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["value", "children"]}},
            "$ref": "#/$defs/node"},
        "enum": {"enum": ["red", 3, None, {"k": [1]}]}, "pattern": {"type": "string", "pattern": "^[A-Z]{3}-\\d{3}$"},
        "formats": {"type": "object", "properties": {f: {"type": "string", "format": f}
                                                     for f in ("date", "date-time", "email", "uuid")}},
        "numbers": {"type": "number", "multipleOf": 0.25, "minimum": 1, "maximum": 2},
        "prefix-items": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        "any-of": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 10}]},
        "all-of": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                             {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
        "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
        "pattern-properties": {"patternProperties": {"^a": {}}}, "if-then": {"if": {}, "then": {}},
    }
    cases = [Case(f"json/{k}", "json-schema", "json_schema", "json_schema", json.dumps(v), A, "JSON Schema 2020-12")
             for k, v in ok.items()]
    bad: dict[str, Any] = {"bad-type": {"type": "strin"}, "required-string": {"type": "object", "required": "name"},
                           "bad-pattern": {"type": "string", "pattern": "(unclosed"},
                           "min-length": {"minLength": -1}, "multiple-of-0": {"multipleOf": 0},
                           "empty-enum": {"enum": []},
                           "properties-number": {"properties": {"a": 3}},
                           "ref-cycle": {"anyOf": [{"$ref": "#"}, {"type": "string"}]},
                           "lookbehind-pattern": {"type": "string", "pattern": "(?<=a)b"}}
    expect = {"ref-cycle": None, "lookbehind-pattern": None, "empty-enum": None}  # spec-valid; engines differ
    cases += [Case(f"json/{k}", "json-schema", "json_schema", "json_schema", json.dumps(v), expect.get(k, R),
                   "JSON Schema 2020-12 metaschema") for k, v in bad.items()]
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(60)},
            "required": ["field_0"]}
    words = {"type": "string", "maxLength": 20, "description": "some words"}
    big = {"type": "object", "properties": {f"field_{i}": words for i in range(1200)}}
    adv: dict[str, tuple[str, str | None]] = {
        "wide-60": (json.dumps(wide), A), "big-1200": (json.dumps(big), A),
        "deep-30": (json.dumps(_deep_schema(30)), A),
        "deep-70": (json.dumps(_deep_schema(70)), None), "deep-400": (json.dumps(_deep_schema(400)), None),
        "items-2000": ('{"items":' * 2000 + "{}" + "}" * 2000, None)}  # valid; each engine has its own depth limit
    cases += [Case(f"json/{k}", "json-schema-adversarial", "json_schema", "json_schema", v, e, adversarial=True)
              for k, (v, e) in adv.items()]
    return cases


def stack_probes() -> list[Case]:
    """Lark chains within the rule limit (1,999 rules + start: the most it allows), in threads with 1, 2 and
    8 MiB of stack."""
    return [Case(f"lark/chain-{n}-stack-{kib}k", "stack", "grammar", "lark", _chain(n, ":", "start"), A,
                 "a valid grammar", stack_kib=kib) for n in (500, 1000, 1999) for kib in (1024, 2048, 8192)]


def full_corpus() -> list[Case]:
    return [*_gbnf(), *_ebnf(), *_lark(), *_regex(), *_json(), *stack_probes()]


def smoke_corpus() -> list[Case]:
    """Three small inputs: the benchmark's own test."""
    return [Case("gbnf/yes-no", "gbnf", "grammar", "gbnf", 'root ::= "yes" | "no"', A),
            Case("regex/unclosed", "regex", "regex", "regex", "(unclosed", R),
            Case("json/person", "json-schema", "json_schema", "json_schema", json.dumps(PERSON), A)]
