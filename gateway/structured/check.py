r"""Checking a finished (non-streamed) answer against the request's constraint, with bounded work.

Each check is kept to work it can finish fast, or not done (the worker that runs it is shared by every
key, and a check past its deadline is wasted). Python's ``re`` backtracks
without a bound: a regex is matched with it when ``regex_cost.steps`` bounds the work for this answer's length
within ``MATCH_BUDGET`` (about a millisecond, measured) and compiling it expands few character ranges; a
schema's ``pattern`` keywords likewise, for the longest string in the answer. Otherwise with RE2 (google-re2:
automata, time linear in the answer; ``\d`` and ``\w`` ASCII, as the engines' decoders read them), which takes
every pattern the gateway accepts (lookarounds and backreferences are refused up front) that does not unroll
past its own size limits; QA found ``(a+)+`` answers passed unchecked before it. RE2 never yields to the worker's
deadline timer (it runs in C), so its work is counted first: at most its program's size times the text's length
(the automaton simulated over the text, when its DFA runs out of memory), ``RE2_BUDGET`` for the whole answer
(sweep 8: a 614-character regex of 20,000 positions took 1.7-9 s on 24-65k characters, and the worker was killed
each time). ``jsonschema`` recurses with
the answer: one nested deeper than ``MAX_ANSWER_DEPTH`` is not checked, and it applies a schema's ``$ref``,
``allOf``, ``anyOf``, ... to every value by every path (``allOf`` never stops early): an answer whose check could
apply more than ``CHECK_BUDGET`` subschemas (counted before it runs, :mod:`~gateway.structured.check_cost`), or
whose schema applies them by rules that count does not follow, is not checked (a strict tool's schema is checked
after generation on engines that cannot enforce it).
An answer that cannot be checked in bounds passes unchecked (the check is a safety net behind engines that
enforce the constraint themselves): :func:`answer_verdict` says why. An answer longer than ``MAX_ANSWER_BYTES``
is not checked either: ``jsonschema`` takes a few microseconds per value, RE2 about 60 ns per character.

Only the checks of ``INLINE`` kinds (a parse and a comparison) run on the event loop. The others run in the
validation workers (:meth:`~gateway.structured.offload.ValidationWorkers.check_answer`) under a deadline: the
bounds above keep the work of one check small, but the final sweep found shapes whose counting missed work
(a ``pattern`` counted as one application that searches for milliseconds, hundreds of ``patternProperties``
recompiled past ``re``'s cache), and a deadline in another process holds whatever a count misses.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from functools import lru_cache
from typing import Any

import orjson

from gateway.structured.bounds import json_depth
from gateway.structured.check_cost import check_cost
from gateway.structured.constraint import Constraint
from gateway.structured.regex_cost import compile_cost, steps

CHECKABLE = frozenset({"json_object", "json_schema", "regex", "choice", "strict_tools"})
INLINE = frozenset({"json_object", "choice"})  # checked on the event loop: a parse and a comparison
MATCH_BUDGET = 20_000_000  # estimated steps; the estimate runs 28x or more above the real work
COMPILE_BUDGET = 10_000  # code points compiling may expand (about 0.1 us each)
MAX_ANSWER_DEPTH = 64  # jsonschema recurses ~8 frames per level
MAX_ANSWER_BYTES = 64 * 1024
CHECK_BUDGET = 50_000  # subschema applications jsonschema may make for one answer (a few microseconds each)
RE2_BUDGET = 20_000_000  # RE2 program instructions x characters for one answer (~6 ns each at worst: ~0.12 s)

log = logging.getLogger("gateway.structured")


class Unchecked(BaseException):
    """The answer cannot be checked within bounds: it passes unchecked, for ``reason``. (A BaseException: the
    worker's deadline raises it from inside ``jsonschema``, which catches Exception in places.)"""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _texts(route: str, raw: bytes) -> list[str] | str:
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "the backend's answer is not JSON"
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        return "the backend's answer has no choices"
    texts = []
    for choice in choices:
        if not isinstance(choice, dict):
            return "a choice is not an object"
        if route == "chat":
            message = choice.get("message")
            text = message.get("content") if isinstance(message, dict) else None
        else:
            text = choice.get("text")
        if not isinstance(text, str):
            return "a choice has no text content"
        texts.append(text)
    return texts


_re2_spent = [0]  # RE2_BUDGET spent on the answer being checked (reset by output_problem)


def _spend_re2(compiled: Any, length: int) -> None:
    """Count one RE2 match of ``length`` characters; Unchecked past the answer's budget."""
    _re2_spent[0] += compiled.programsize * (length + 1)
    if _re2_spent[0] > RE2_BUDGET:
        raise Unchecked(f"matching its regex could take more than {RE2_BUDGET:.0e} automaton steps")


@lru_cache(maxsize=32)  # (each holds its DFA's memory, up to max_mem: sweep 8 saw 2.7 MB a pattern)
def _re2(pattern: str) -> Any | None:
    """``pattern`` compiled by RE2 (matching in time linear in the text), or None where RE2 cannot take it."""
    import re2

    options = re2.Options()
    options.log_errors = False  # (else absl writes each refusal to standard error)
    options.never_capture = True
    options.max_mem = 4 << 20
    try:
        return re2.compile(pattern, options)
    except re2.error:
        return None


def regex_too_costly(pattern: str, length: int, search: bool = False) -> str | None:
    """Why matching ``pattern`` against ``length`` characters is not bounded within budget, or None."""
    bound = steps(pattern, length, search)
    if bound is None:
        return "its regex can backtrack exponentially (or is too long to analyse)"
    if bound > MATCH_BUDGET:
        return f"its regex could take ~{bound:.1e} steps on {length} characters"
    if (compile_cost(pattern) or 0) > COMPILE_BUDGET:
        return "its regex has character ranges too wide to compile within bounds"
    return None


def _longest_string(value: Any) -> int:
    """The length of the longest string (value or key) in a JSON value."""
    longest = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            longest = max(longest, len(node))
        elif isinstance(node, dict):
            longest = max(longest, max(map(len, node), default=0))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return longest


@lru_cache(maxsize=64)
def _schema_patterns(text: bytes) -> tuple[tuple[str, bool], ...]:
    """Every ``pattern`` regex of a schema (by its serialised form), and every ``patternProperties`` one (True)."""
    found: list[tuple[str, bool]] = []
    stack = [orjson.loads(text)]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append((node["pattern"], False))
            if isinstance(node.get("patternProperties"), dict):
                found.extend((key, True) for key in node["patternProperties"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return tuple(found)


@lru_cache(maxsize=16)
def _with_re2_patterns(cls: Any) -> Any:
    """The jsonschema validator class ``cls`` with its ``pattern`` keyword matched by RE2."""
    from jsonschema import validators
    from jsonschema.exceptions import ValidationError

    def pattern(validator: Any, regex: str, instance: Any, schema: Any) -> Any:
        if not validator.is_type(instance, "string"):
            return
        compiled = _re2(regex)
        if compiled is None:
            return
        _spend_re2(compiled, len(instance))
        if compiled.search(instance) is None:
            yield ValidationError(f"{instance!r} does not match {regex!r}")

    return validators.extend(cls, {"pattern": pattern})  # type: ignore[no-untyped-call]


def _schema_problem(text: str, value: Any, constraint: Constraint, budget: list[int]) -> str | None:
    """Why ``value`` does not match the schema; None when it does or the check would not be bounded.
    ``budget``: the subschema applications left for the whole answer (every call, every choice), spent here.
    Raises Unchecked where the check would not be bounded: the whole answer is then unchecked (a later call or
    choice is not counted again)."""
    if len(text) > MAX_ANSWER_BYTES:
        raise Unchecked(f"the answer is longer than {MAX_ANSWER_BYTES} characters")
    depth, _, _ = json_depth(value, MAX_ANSWER_DEPTH)
    if depth > MAX_ANSWER_DEPTH:
        raise Unchecked(f"the answer nests deeper than {MAX_ANSWER_DEPTH} levels")
    cost = check_cost(constraint.schema, value, budget[0])
    if cost is None:
        raise Unchecked("the schema applies its subschemas by rules the gateway cannot bound ($anchor, $id, "
                        "$dynamicRef, dependentSchemas, unevaluated*)")
    if cost > budget[0]:
        raise Unchecked(f"checking the answer could apply more than {CHECK_BUDGET} subschemas")
    budget[0] -= cost
    patterns = _schema_patterns(orjson.dumps(constraint.schema))
    linear = False  # a pattern Python's re cannot match within bounds: every pattern is matched by RE2 then
    if patterns:
        longest = _longest_string(value)
        for pattern, property_key in patterns:
            why = regex_too_costly(pattern, longest, search=True)
            if why is not None:
                if property_key or _re2(pattern) is None:  # (patternProperties stay jsonschema's own)
                    raise Unchecked(why)
                linear = True
    from jsonschema.exceptions import UnknownType, best_match
    from jsonschema.validators import validator_for
    from referencing.exceptions import Unresolvable

    schema = constraint.schema
    try:
        # checked against its metaschema up front: not again per answer (as jsonschema.validate would)
        cls = validator_for(schema)
        error = best_match((_with_re2_patterns(cls) if linear else cls)(schema).iter_errors(value))
    except (Unresolvable, UnknownType) as exc:  # e.g. a $ref to a document the gateway does not have
        raise Unchecked(f"{type(exc).__name__}: {exc}") from None
    except (TypeError, ValueError, AttributeError) as exc:  # a schema jsonschema cannot apply (draft 3's schema
        # types raised TypeError in best_match): the gateway's own limit, never the backend's failure
        raise Unchecked(f"jsonschema could not apply it ({type(exc).__name__})") from None
    except RecursionError:  # only with limits.max_nesting far above its default: in-place nesting recurses
        raise Unchecked("the schema nests too deeply to check an answer against it") from None
    if error is not None:
        return f"the answer does not match the schema: {error.message}"
    return None


def _tool_problem(raw: bytes, constraint: Constraint) -> str | None:
    """Why a call of a strict tool in the answer has arguments outside the tool's parameters schema, or None. An
    answer without such calls (text, or calls of other tools) satisfies strict tools."""
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "the backend's answer is not JSON"
    strict: dict[str, Any] = constraint.schema
    budget = [CHECK_BUDGET]  # (for the whole answer: every call of every choice)
    for choice in doc.get("choices") or () if isinstance(doc, dict) else ():
        message = choice.get("message") if isinstance(choice, dict) else None
        for call in (message.get("tool_calls") or ()) if isinstance(message, dict) else ():
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or name not in strict:
                continue
            assert isinstance(function, dict)
            arguments = function.get("arguments")
            if not isinstance(arguments, str):
                return f"a call of the strict tool {name!r} has no arguments"
            try:
                value = orjson.loads(arguments)
            except orjson.JSONDecodeError as exc:
                return f"the arguments of a call of the strict tool {name!r} are not valid JSON: {exc}"
            schema = strict[name] if strict[name] is not None else {"type": "object"}
            problem = _schema_problem(arguments, value, replace(constraint, schema=schema), budget)
            if problem is not None:
                return f"the arguments of a call of the strict tool {name!r} do not match its parameters: " + \
                    problem.removeprefix("the answer does not match the schema: ")
    return None


def strict_calls(raw: bytes, constraint: Constraint) -> bool:
    """Whether the answer calls a strict tool (only then has a strict-tools check anything to check)."""
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True  # (the check says what is wrong with it)
    strict = constraint.schema
    for choice in doc.get("choices") or () if isinstance(doc, dict) else ():
        message = choice.get("message") if isinstance(choice, dict) else None
        for call in (message.get("tool_calls") or ()) if isinstance(message, dict) else ():
            function = call.get("function") if isinstance(call, dict) else None
            name = function.get("name") if isinstance(function, dict) else None
            if isinstance(name, str) and name in strict:
                return True
    return False


def answer_verdict(route: str, raw: bytes, constraint: Constraint) -> tuple[str | None, str | None]:
    """Why the answer does not satisfy the constraint (None when it does), and why it was not checked (None
    when it was)."""
    try:
        return output_problem(route, raw, constraint), None
    except Unchecked as exc:
        log.debug("answer not checked against the %s constraint: %s", constraint.describe(), exc.reason)
        return None, exc.reason


def output_problem(route: str, raw: bytes, constraint: Constraint) -> str | None:
    """Why the answer does not satisfy the constraint, or None when it does; raises Unchecked where the check
    would not be bounded."""
    if constraint.kind not in CHECKABLE:
        return None
    _re2_spent[0] = 0
    if constraint.kind == "strict_tools":
        return _tool_problem(raw, constraint) if route == "chat" else None
    texts = _texts(route, raw)
    if isinstance(texts, str):
        return texts
    budget = [CHECK_BUDGET]  # (for the whole answer: every choice)
    for text in texts:
        if constraint.kind in ("json_object", "json_schema"):
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                return f"the answer is not valid JSON: {exc}"
            if constraint.kind == "json_object":
                if not isinstance(value, dict):
                    return "the answer is JSON but not an object"
                continue
            problem = _schema_problem(text, value, constraint, budget)
            if problem is not None:
                return problem
        elif constraint.kind == "regex":
            why = regex_too_costly(constraint.pattern, len(text))
            if why is None:
                matched = re.fullmatch(constraint.pattern, text) is not None
            else:
                linear = _re2(constraint.pattern) if len(text) <= MAX_ANSWER_BYTES else None
                if linear is None:
                    raise Unchecked(why)
                _spend_re2(linear, len(text))
                matched = linear.fullmatch(text) is not None
            if not matched:
                return "the answer does not match the regex"
        elif text not in constraint.choices:
            return "the answer is not one of the choices"
    return None
