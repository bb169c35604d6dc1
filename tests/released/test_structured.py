"""What the gateway sends for each constraint reaches the engine's own sampling parameters, in the engine's own
released code (SGLang, vLLM: newest and oldest pinned release), on the chat and completions routes.

For every constraint kind an engine can honour (its spec's ``structured`` and ``can_honour``), the body the
engine's adapter writes is validated by the engine's request model and turned into sampling parameters by the
engine's code; the constraint must be there, meaning what the client asked (the same schema, regex, choices,
grammar), and no field the gateway sent may have been dropped by the model (pydantic ignores unknown fields: a
constraint in a field the engine does not read is an HTTP 200 with unconstrained output).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from gateway.engines.registry import ENGINES, create_adapter
from gateway.structured import can_honour, extract
from tests.released.engines import Parsed, RequestSide
from tests.released.sources import SGLANG_NEWEST, SGLANG_OLDEST, VLLM_NEWEST, VLLM_OLDEST, Release

pytestmark = pytest.mark.unit

RELEASES = (SGLANG_NEWEST, SGLANG_OLDEST, VLLM_NEWEST, VLLM_OLDEST)
ROUTES = ("chat", "completions")

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
          "required": ["n"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]+"
CHOICES = ["red", "green", "blue (dark)"]  # (a regex metacharacter: the alternation must escape it)
GBNF = 'root ::= "yes" | "no"'
EBNF = 'root ::= "yes" | "no" | Regex("[0-9]+")'  # xgrammar's Regex macro: EBNF, not GBNF
LARK = 'start: "yes" | "no"'
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
    {"type": "tag", "begin": "<f=get>", "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "</f>"}]}}
LEGACY_TAG = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=get>", "schema": SCHEMA, "end": "</f>"}]}
OPTIONS = {"disable_any_whitespace": True, "disable_additional_properties": True, "whitespace_pattern": "[ ]?"}

ASKED_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
# what a client asks, in the spellings the gateway accepts, by the support word an engine must have
ASKED: dict[str, dict[str, Any]] = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema": {"response_format": ASKED_SCHEMA},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar:gbnf": {"grammar": GBNF},
    "grammar:ebnf": {"grammar": EBNF, "grammar_syntax": "ebnf"},
    "grammar:lark": {"grammar": LARK, "grammar_syntax": "lark"},
    "structural_tag": {"response_format": TAG},
    "structural_tag:vllm": {"structured_outputs": {"structural_tag": json.dumps(TAG)}},
    "structural_tag:legacy": {"response_format": LEGACY_TAG},
    "structural_tag:at_least_one": {"response_format": {**LEGACY_TAG, "at_least_one": True}},
    # vLLM's options, beside a constraint from another field (vLLM merges the two) and with one of its own
    "options": {"response_format": ASKED_SCHEMA, "structured_outputs": OPTIONS},
    "options:regex": {"structured_outputs": {"regex": REGEX, "disable_any_whitespace": True}},
}


def _base(route: str) -> dict[str, Any]:
    common = {"model": "m", "stream": True, "temperature": 0.5}
    if route == "chat":
        return {**common, "max_completion_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    return {**common, "max_tokens": 16, "prompt": "hi"}


def _cases() -> list[Any]:
    cases = []
    for release in RELEASES:
        support = ENGINES[release.package].structured
        for route in ROUTES:
            for kind, fields in ASKED.items():
                constraint = extract(fields)
                assert constraint is not None
                if can_honour(constraint, support):
                    cases.append(pytest.param(release, route, kind, id=f"{release.label}-{route}-{kind}"))
    return cases


def _sent(release: Release, route: str, kind: str) -> dict[str, Any]:
    """The body the gateway sends the engine for this request."""
    body = {**_base(route), **json.loads(json.dumps(ASKED[kind]))}
    constraint = extract(body)
    return create_adapter(release.package).prepare_body(route, body, constraint)


def _carried(found: dict[str, Any]) -> dict[str, Any]:
    """The engine's constraint fields in one vocabulary: a schema or tag parsed, SGLang's ``ebnf`` as ``grammar``."""
    carried: dict[str, Any] = {}
    for key, value in found.items():
        if key in ("json", "json_schema"):
            carried["json"] = json.loads(value) if isinstance(value, str) else value
        elif key == "structural_tag":  # (a JSON string in both engines' sampling parameters)
            carried[key] = json.loads(value)
        elif key == "ebnf":
            carried["grammar"] = value
        else:
            carried[key] = value
    return carried


CASES = _cases()


@pytest.mark.parametrize(("release", "route", "kind"), CASES)
def test_the_constraint_reaches_the_engines_sampling_params(
    request_side: Callable[[Release], RequestSide], release: Release, route: str, kind: str
) -> None:
    sent = _sent(release, route, kind)
    parsed = request_side(release).parse(route, sent)
    carried = _carried(parsed.constraint)
    engine = release.package
    if kind.startswith("structural_tag"):
        asked = extract(ASKED[kind])
        assert asked is not None
        # SGLang's legacy model adds its at_least_one default: the same tag
        legacy = engine == "sglang" and "structures" in asked.tag
        expect = {"at_least_one": False, **asked.tag} if legacy else asked.tag
        assert carried == {"structural_tag": expect}, sent
    elif kind.startswith("options"):  # (vLLM's alone: routing sends them nowhere else)
        asked = extract(ASKED[kind])
        assert asked is not None
        assert parsed.options == {"disable_any_whitespace": False, "disable_additional_properties": False,
                                  "whitespace_pattern": None, **dict(asked.options)}, sent
        assert carried == ({"json": SCHEMA} if kind == "options" else {"regex": REGEX}), sent
    elif kind == "json_schema":
        assert carried == {"json": SCHEMA}, f"sent {sent}"
    elif kind == "json_object":
        assert carried == ({"json_object": True} if engine == "vllm" else {"json": {"type": "object"}}), sent
    elif kind == "regex":
        assert carried == {"regex": REGEX}, sent
    elif kind == "choice" and engine == "vllm":
        assert carried == {"choice": CHOICES}, sent
    elif kind == "choice":
        assert set(carried) == {"regex"}, sent
        assert _matches_exactly(carried["regex"], CHOICES), carried["regex"]
    else:  # a grammar: in the dialect asked when the engine parses it, else as the gateway converted it
        assert set(carried) == {"grammar"}, sent
        asked = ASKED[kind]["grammar"]
        if kind in ("grammar:ebnf", "grammar:lark"):
            assert carried["grammar"] == asked
        else:
            assert all(literal in carried["grammar"] for literal in ('"yes"', '"no"')), carried["grammar"]


def _matches_exactly(pattern: str, choices: list[str]) -> bool:
    others = ["", "red|green", "redgreen", "blue (dark", "blue dark", "red ", "REd", *(c + "x" for c in choices)]
    return (all(re.fullmatch(pattern, c) for c in choices)
            and not any(re.fullmatch(pattern, o) for o in others))


@pytest.mark.parametrize(("release", "route", "kind"), CASES)
def test_no_field_the_gateway_sends_is_dropped(
    request_side: Callable[[Release], RequestSide], release: Release, route: str, kind: str
) -> None:
    sent = _sent(release, route, kind)
    parsed = request_side(release).parse(route, sent)
    assert dropped(sent, parsed.request) == []


def dropped(sent: Any, read: Any, where: str = "") -> list[str]:
    """The keys of ``sent`` (a JSON object) that the engine's validated ``read`` has no field for: kept at most
    as a pydantic extra, which the engine never reads. Nested objects are followed where the engine's field is
    a model or a dataclass (messages typed by a stubbed class are not)."""
    if not isinstance(sent, dict):
        return []
    if isinstance(read, BaseModel):
        by_key = {(info.alias or name): name for name, info in type(read).model_fields.items()}
        by_key.update({name: name for name in type(read).model_fields})
        lost = []
        for key, value in sent.items():
            name = by_key.get(key)
            if name is None:
                lost.append(where + key)
            else:
                lost += dropped(value, getattr(read, name), f"{where}{key}.")
        return lost
    if dataclasses.is_dataclass(read) and not isinstance(read, type):
        names = {f.name for f in dataclasses.fields(read)}
        return [where + key for key in sent if key not in names]
    return []


@pytest.mark.parametrize("release", RELEASES, ids=[r.label for r in RELEASES])
def test_a_field_the_engine_does_not_read_is_caught(
    request_side: Callable[[Release], RequestSide], release: Release
) -> None:
    """These tests can fail: a constraint in a field the engine ignores (vLLM's removed ``guided_regex``,
    TabbyAPI's ``regex_pattern`` sent to SGLang) reaches no sampling parameter and is reported dropped."""
    field = "guided_regex" if release.package == "vllm" else "regex_pattern"
    body = {**_base("chat"), field: REGEX}
    parsed: Parsed = request_side(release).parse("chat", body)
    assert parsed.constraint == {}
    assert dropped(body, parsed.request) == [field]


def test_the_engines_modules_stay_out_of_sys_modules(request_side: Callable[[Release], RequestSide]) -> None:
    """Loaded engine code and its stubs are in ``sys.modules`` only while it runs: other tests, and the other
    release of the same engine, never import them by accident."""
    for release in RELEASES:
        request_side(release).parse("chat", _sent(release, "chat", "regex"))
    assert not [name for name in sys.modules if name.split(".")[0] in ("vllm", "sglang")]
    assert sys.modules.get("regex") is not re  # (the stand-in vLLM 0.23 is given for the regex package)


@pytest.mark.parametrize("release", RELEASES, ids=[r.label for r in RELEASES])
def test_what_the_gateway_keeps_from_an_engine_is_what_that_engine_drops(
    request_side: Callable[[Release], RequestSide], release: Release
) -> None:
    """Why a legacy tag's ``at_least_one`` goes to SGLang alone and ``disable_fallback`` is refused: vLLM's legacy
    model has no ``at_least_one`` (its xgrammar backend reads structures and triggers only), and no released
    ``StructuredOutputsParams`` has a ``disable_fallback``; SGLang's legacy model reads ``at_least_one``."""
    side = request_side(release)
    body = {**_base("chat"), "response_format": {**LEGACY_TAG, "at_least_one": True}}
    lost = dropped(body, side.parse("chat", body).request)
    assert lost == (["response_format.at_least_one"] if release.package == "vllm" else [])
    if release.package == "vllm":
        body = {**_base("chat"), "structured_outputs": {"json": SCHEMA, "disable_fallback": True}}
        assert dropped(body, side.parse("chat", body).request) == ["structured_outputs.disable_fallback"]
