"""What an emulated model says: a planned list of output pieces (tokens), unconstrained or constrained.

Unconstrained text is drawn from a small word list; its natural length (where the model would emit EOS) is
uniform in the profile's ``[natural_min_tokens, natural_max_tokens]``. Constrained text comes whole from
:mod:`gateway.sim.constrained` and is then streamed piece by piece; ``max_tokens`` truncates either one
(``finish_reason`` ``"length"``), as a real engine does.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from typing import Any, Literal

from gateway.sim.tokenizer import Tokenizer

ConstraintKind = Literal["json", "json_object", "regex", "choice", "gbnf", "ebnf", "lark", "structural_tag"]

# every word is at most 6 letters, so each is exactly one token of the sim tokenizer
_WORDS = ("the", "a", "model", "token", "server", "cache", "batch", "prefix", "slot", "fast", "slow", "queue",
          "answer", "is", "and", "of", "to", "in", "we", "it", "router", "engine", "load", "page", "block",
          "step", "user", "prompt", "reply", "stream", "sim", "data", "value", "next", "then", "so")


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    value: Any


@dataclass
class Plan:
    pieces: list[str]
    ids: list[int]
    finish_reason: str  # "stop" | "length"
    reasoning: int = 0  # the first ``reasoning`` pieces are reasoning, the rest the answer

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def request_rng(seed: int, prompt: list[int], salt: int = 0) -> random.Random:
    """Same seed, prompt and salt: same output, in every process."""
    digest = zlib.crc32(b"".join(i.to_bytes(4, "little") for i in prompt[-256:]))
    return random.Random(f"{seed}:{len(prompt)}:{digest}:{salt}")


def constrained_text(constraint: Constraint, rng: random.Random) -> str:
    """Raises ``gateway.structured.syntax.ConstraintError`` for a constraint it cannot satisfy."""
    from gateway.sim import constrained as c

    kind, value = constraint.kind, constraint.value
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        return json.dumps(c.json_instance(schema, rng))
    if kind == "json_object":
        return json.dumps(c.json_instance({"type": "object"}, rng))
    if kind == "regex":
        return c.regex_sample(value, rng)
    if kind == "choice":
        return c.choice_sample(value, rng)
    if kind == "gbnf":
        return c.gbnf_sample(value, rng)
    if kind == "ebnf":
        return c.ebnf_sample(value, rng)
    if kind == "structural_tag":  # (vLLM and SGLang hand on a JSON string)
        return c.structural_tag_sample(json.loads(value) if isinstance(value, str) else value, rng)
    return c.lark_sample(value, rng)


def plan_output(tok: Tokenizer, rng: random.Random, max_tokens: int | None, natural: tuple[int, int],
                constraint: Constraint | None = None, ignore_eos: bool = False) -> Plan:
    if constraint is not None:
        pieces = tok.pieces(constrained_text(constraint, rng)) or [""]
        finish = "stop"
        if max_tokens is not None and max_tokens < len(pieces):
            pieces, finish = pieces[: max(1, max_tokens)], "length"
    else:
        n = rng.randint(*natural)
        finish = "stop"
        if max_tokens is not None and (ignore_eos or max_tokens < n):
            n, finish = max(1, max_tokens), "length"
        words = [_WORDS[rng.randrange(len(_WORDS))] for _ in range(n)]
        pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
    return Plan(pieces, [tok.piece_id(p) for p in pieces], finish)
