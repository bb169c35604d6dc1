"""Constrained sampling: the emulators' sampler against a mask-driven random walk with llguidance and a
byte-level tokenizer (run in a worker process: ``--sampling-worker N``)."""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import orjson

from gateway.bench.constraints.corpus import JSON_GBNF, LARK_JSON, PERSON

SAMPLED: list[tuple[str, str, Any]] = [
    ("regex-phone", "regex", r"\d{3}-\d{4}"), ("regex-sentence", "regex", r"[A-Z][a-z]+ (?:[a-z]+ )*end\."),
    ("json-person", "json", PERSON), ("gbnf-json", "gbnf", JSON_GBNF), ("lark-json", "lark", LARK_JSON),
]
_CLOSERS = frozenset(b'"}]).')


class _Bytes:
    """A vocabulary of the 256 bytes and an end-of-sequence token."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _llg_sample(matcher: Any, rng: random.Random, soft: int, cap: int) -> tuple[bytes, bool, int]:
    """Uniform over the allowed printable bytes; past ``soft`` bytes, end or close when allowed. Returns the
    text, whether the matcher accepted it, and the masks computed."""
    matcher.reset()
    out, masks = bytearray(), 0
    while len(out) < cap:
        for b in matcher.compute_ff_bytes():  # forced bytes need no mask
            matcher.consume_token(b)
            out.append(b)
        bits = int.from_bytes(matcher.compute_bitmask(), "little")
        masks += 1
        allowed = [i for i in range(256) if bits >> i & 1]
        if bits >> 256 & 1 and (len(out) >= soft or not allowed or rng.random() < 0.05):
            return bytes(out), matcher.is_accepting(), masks
        pool = [i for i in allowed if 32 <= i < 127] or allowed
        if not pool:
            return bytes(out), False, masks
        if len(out) >= soft:
            pool = [i for i in pool if i in _CLOSERS] or pool
        b = rng.choice(pool)
        matcher.consume_token(b)
        out.append(b)
    return bytes(out), False, masks


def _valid(kind: str, value: Any, text: str) -> bool | None:
    """Checked by an independent oracle where there is one (a Lark grammar's JSON strings allow any escape)."""
    if kind == "lark":
        return None
    try:
        if kind == "regex":
            return re.fullmatch(value, text) is not None
        parsed = json.loads(text)
        if kind == "json":
            import jsonschema

            jsonschema.validate(parsed, value)
        return True
    except (ValueError, Exception):
        return False


def sampling_main(samples: int) -> dict[str, Any]:
    """The emulators' sampler (``gateway.sim.generation.constrained_text``) against a mask-driven random walk
    with llguidance: time per sample (after a warm-up), bytes, share finished and valid."""
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper, grammar_from

    from gateway.sim.generation import Constraint as SimConstraint
    from gateway.sim.generation import constrained_text

    tokenizer = LLTokenizer(TokenizerWrapper(_Bytes()))
    found: dict[str, Any] = {}
    for name, kind, value in SAMPLED:
        sim = SimConstraint(kind, value)  # type: ignore[arg-type]
        constrained_text(sim, random.Random(-1))
        ours_t, ours_len, ours_ok = [], [], 0.0
        for seed in range(samples):
            start = time.perf_counter()
            text = constrained_text(sim, random.Random(seed))
            ours_t.append(time.perf_counter() - start)
            ours_len.append(len(text.encode()))
            ours_ok += _valid(kind, value, text) or 0
        start = time.perf_counter()
        grammar = (LLMatcher.grammar_from_json_schema(value, defaults={"whitespace_flexible": False})
                   if kind == "json" else grammar_from(kind, value))  # type: ignore[arg-type]
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        compile_s = time.perf_counter() - start
        llg_t, llg_len, finished, llg_ok, mask_s = [], [], 0, 0.0, []
        for seed in range(samples):
            start = time.perf_counter()
            raw, accepted, masks = _llg_sample(matcher, random.Random(seed), soft=48, cap=2048)
            elapsed = time.perf_counter() - start
            llg_t.append(elapsed)
            llg_len.append(len(raw))
            mask_s.append(elapsed / max(1, masks))
            finished += accepted
            llg_ok += accepted and (_valid(kind, value, raw.decode("utf-8", "replace")) or 0)
        found[name] = {
            "ours": {"median_s": statistics.median(ours_t), "median_bytes": statistics.median(ours_len),
                     "valid": ours_ok / samples if kind != "lark" else None},
            "llguidance": {"compile_s": compile_s, "median_s": statistics.median(llg_t),
                           "median_bytes": statistics.median(llg_len), "per_mask_s": statistics.median(mask_s),
                           "finished": finished / samples, "valid": llg_ok / samples if kind != "lark" else None,
                           "error": matcher.get_error() or None},
        }
    return {"samples": samples, "tokenizer": "bytes (256 + EOS)", "policy": "uniform over allowed printable bytes; "
            "EOS with p=0.05 when allowed, and always past 48 bytes; past 48 bytes prefer closing bytes; cap 2048",
            "constraints": found}


def run_sampling(samples: int, timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "gateway.bench.constraints", "--sampling-worker", str(samples)],
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr.decode()[-500:]}"}
    return orjson.loads(proc.stdout)  # type: ignore[no-any-return]
