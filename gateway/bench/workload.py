"""Workloads: the list of requests a benchmark sends, generated once, deterministically from a seed.

Every target of a comparison gets exactly the same requests. Lengths are in *words* of 3-6 ASCII letters,
each preceded by a space: one token per word for the emulators' tokenizer and one or two for real BPE
tokenizers, so "length 512" means about 512 tokens.

* ``shared-prefix``: ``groups`` system prompts of ``system_len`` words, ``prompts_per_group`` questions of
  ``question_len`` words each (SGLang's "generated shared prefix" shape, smaller). Uniform popularity sends
  every (group, question) pair in shuffled order; ``zipf`` draws the group with weight ``1 / rank**zipf_s``.
* ``multi-turn``: ``conversations`` chats of ``turns`` turns; turn *t* carries the whole history (user
  messages of ``question_len`` words, synthetic assistant replies of ``output_len`` words). Requests are
  ordered turn-major: turn *t* of every conversation comes before turn *t+1* of any, so a conversation's
  history exists (in a prefix cache) when its next turn arrives.
* ``random``: input and output lengths drawn uniformly from ``[input_min, input_max]`` and
  ``[output_min, output_max]``.
* Any workload: ``structured_fraction`` of the requests (chosen by the seed) ask for
  ``response_format: json_schema``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

WorkloadKind = Literal["shared-prefix", "multi-turn", "random"]
KINDS: tuple[WorkloadKind, ...] = ("shared-prefix", "multi-turn", "random")

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "so", "vi", "de", "pa", "zu", "fe", "gi", "ho", "ba", "wen")

ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class WorkloadConfig:
    kind: WorkloadKind = "shared-prefix"
    count: int | None = None  # default: one pass over the workload's distinct prompts (random: 100)
    seed: int = 0
    output_len: int = 64
    ignore_eos: bool = False  # ask engines to produce exactly output_len tokens (vLLM, SGLang, llama.cpp)
    structured_fraction: float = 0.0
    # shared-prefix
    groups: int = 8
    prompts_per_group: int = 4
    system_len: int = 512
    question_len: int = 64
    popularity: Literal["uniform", "zipf"] = "uniform"
    zipf_s: float = 1.1
    # multi-turn
    conversations: int = 8
    turns: int = 4
    # random
    input_min: int = 32
    input_max: int = 512
    output_min: int = 16
    output_max: int = 128

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown workload {self.kind!r}; one of {', '.join(KINDS)}")
        if not 0.0 <= self.structured_fraction <= 1.0:
            raise ValueError("structured_fraction must be within 0..1")
        for name in ("groups", "prompts_per_group", "conversations", "turns", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.input_min > self.input_max or self.output_min > self.output_max or self.input_min < 1:
            raise ValueError("random lengths: need 1 <= input_min <= input_max and output_min <= output_max")
        if self.count is not None and self.count < 1:
            raise ValueError("count must be at least 1")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. ``body`` lacks ``model`` and the streaming fields (set per target)."""

    index: int
    body: dict[str, Any]
    prompt_words: int
    output_len: int
    group: int | None = None
    conversation: int | None = None
    turn: int | None = None
    structured: bool = False
    tags: dict[str, Any] = field(default_factory=dict)


def words(rng: random.Random, n: int) -> str:
    """``n`` pseudo-words, each ``" "`` + 3-6 letters (one emulator token each)."""
    out = []
    for _ in range(n):
        w = "".join(rng.choice(_SYLLABLES) for _ in range(2))[:6]
        out.append(" " + w)
    return "".join(out)


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalised Zipf popularity of ranks 1..n: ``w_k`` proportional to ``1 / k**s``."""
    if n < 1:
        raise ValueError("n must be at least 1")
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def _body(messages: list[dict[str, str]], output_len: int, cfg: WorkloadConfig) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "max_tokens": output_len}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def _shared_prefix(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    systems = [f"You are assistant {g}." + words(random.Random(f"{cfg.seed}-sys-{g}"), cfg.system_len)
               for g in range(cfg.groups)]
    questions = [[words(random.Random(f"{cfg.seed}-q-{g}-{q}"), cfg.question_len).strip()
                  for q in range(cfg.prompts_per_group)] for g in range(cfg.groups)]
    total = cfg.count or cfg.groups * cfg.prompts_per_group
    picks: list[tuple[int, int]] = []
    if cfg.popularity == "uniform":
        pairs = [(g, q) for g in range(cfg.groups) for q in range(cfg.prompts_per_group)]
        while len(picks) < total:
            batch = pairs[:]
            rng.shuffle(batch)
            picks.extend(batch)
        picks = picks[:total]
    else:
        weights = zipf_weights(cfg.groups, cfg.zipf_s)
        groups = rng.choices(range(cfg.groups), weights=weights, k=total)
        picks = [(g, rng.randrange(cfg.prompts_per_group)) for g in groups]
    return [
        BenchRequest(
            index=i,
            body=_body([{"role": "system", "content": systems[g]}, {"role": "user", "content": questions[g][q]}],
                       cfg.output_len, cfg),
            prompt_words=cfg.system_len + cfg.question_len, output_len=cfg.output_len, group=g,
            tags={"question": q},
        )
        for i, (g, q) in enumerate(picks)
    ]


def _multi_turn(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": f"You are a helpful assistant in chat {c}."}] for c in range(cfg.conversations)
    ]
    limit = cfg.count or cfg.conversations * cfg.turns
    for turn in range(cfg.turns):
        for c in range(cfg.conversations):
            if len(out) >= limit:
                return out
            conv_rng = random.Random(f"{cfg.seed}-conv-{c}-{turn}")
            history = histories[c]
            history.append({"role": "user", "content": words(conv_rng, cfg.question_len).strip()})
            messages = [dict(m) for m in history]
            prompt_words = sum(len(m["content"].split()) for m in messages)
            out.append(BenchRequest(index=len(out), body=_body(messages, cfg.output_len, cfg),
                                    prompt_words=prompt_words, output_len=cfg.output_len, conversation=c,
                                    turn=turn))
            # the reply the next turn carries: synthetic, so every target sees identical prompts
            history.append({"role": "assistant", "content": words(conv_rng, cfg.output_len).strip()})
    return out


def _random(cfg: WorkloadConfig, rng: random.Random) -> list[BenchRequest]:
    out = []
    for i in range(cfg.count or 100):
        n_in = rng.randint(cfg.input_min, cfg.input_max)
        n_out = rng.randint(cfg.output_min, cfg.output_max)
        text = words(random.Random(f"{cfg.seed}-rand-{i}"), n_in).strip()
        out.append(BenchRequest(index=i, body=_body([{"role": "user", "content": text}], n_out, cfg),
                                prompt_words=n_in, output_len=n_out))
    return out


def _make_structured(req: BenchRequest) -> BenchRequest:
    body = dict(req.body)
    messages = [dict(m) for m in body["messages"]]
    messages[-1]["content"] += " Answer in JSON with an answer and a confidence."
    body["messages"] = messages
    body["response_format"] = {"type": "json_schema",
                               "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    return BenchRequest(index=req.index, body=body, prompt_words=req.prompt_words, output_len=req.output_len,
                        group=req.group, conversation=req.conversation, turn=req.turn, structured=True,
                        tags=req.tags)


def build_workload(cfg: WorkloadConfig) -> list[BenchRequest]:
    """The requests of ``cfg``, identical for the same configuration in every process."""
    rng = random.Random(cfg.seed)
    if cfg.kind == "shared-prefix":
        requests = _shared_prefix(cfg, rng)
    elif cfg.kind == "multi-turn":
        requests = _multi_turn(cfg, rng)
    else:
        requests = _random(cfg, rng)
    if cfg.structured_fraction > 0:
        pick = random.Random(f"{cfg.seed}-structured")
        requests = [_make_structured(r) if pick.random() < cfg.structured_fraction else r for r in requests]
    return requests
