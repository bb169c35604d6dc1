"""A real tokenizer for the emulators and the gateway to share, generated: no model can be downloaded here.

:func:`ensure_tokenizer` writes a Hugging Face model directory: ``tokenizer.json`` (a byte-level BPE of
:data:`VOCAB_SIZE` entries trained with ``tokenizers`` on :func:`corpus`), and ``tokenizer_config.json`` with a
ChatML chat template (:data:`CHAT_TEMPLATE`), ``bos_token``, ``eos_token`` and ``model_max_length``. Byte-level
BPE encodes any text at all; the corpus mixes the benchmarks' pseudo-words (syllable pairs, as
``gateway.bench.workload`` writes them), English, digits, punctuation and JSON, so prompts cost one or two
tokens a word, as with a real model's tokenizer.

Everything is seeded and the trainer is deterministic: every run, on any machine, writes the same bytes (about
0.2 s). The directory records :data:`VERSION`; a directory written by another version is rewritten.

``python -m gateway.sim tokenizer --out DIR`` writes it from the command line.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

VERSION = "sim-bpe-1"  # bump when the corpus, the trainer's settings or the template change
VOCAB_SIZE = 6000
MODEL_MAX_LENGTH = 32768
BOS, EOS = "<s>", "</s>"
SPECIAL_TOKENS = (BOS, EOS, "<|im_start|>", "<|im_end|>")

# ChatML (as Qwen writes it), opened with BOS. Roles system, developer, user, assistant and tool; string content
# (vLLM joins a list of parts into one string for such templates); ``tools`` listed in the system turn, each as
# tojson; assistant ``tool_calls`` as <tool_call> JSON (arguments as given, a string, or tojson of a mapping).
CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- set ns = namespace(first=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
  {%- set ns.first = 1 -%}
{%- endif -%}
{%- if ns.first or tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if ns.first and messages[0]['content'] is string -%}
    {{- messages[0]['content'] -}}
  {%- endif -%}
  {%- if tools -%}
    {{- '\\n\\n' if ns.first else '' -}}
    {{- '# Tools\\n<tools>' -}}
    {%- for tool in tools -%}
      {{- '\\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\\n</tools>' -}}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages[ns.first:] -%}
  {%- if message['role'] not in ('system', 'developer', 'user', 'assistant', 'tool') -%}
    {{- raise_exception('Unsupported role: ' + message['role']) -}}
  {%- endif -%}
  {{- '<|im_start|>' + message['role'] + '\\n' -}}
  {%- if message['content'] is string -%}
    {{- message['content'] -}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}
    {%- for call in message['tool_calls'] -%}
      {%- set fn = call['function'] if call['function'] is defined else call -%}
      {%- if message['content'] or not loop.first -%}
        {{- '\\n' -}}
      {%- endif -%}
      {{- '<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' -}}
      {%- if fn['arguments'] is string -%}
        {{- fn['arguments'] -}}
      {%- else -%}
        {{- fn['arguments'] | tojson -}}
      {%- endif -%}
      {{- '}\\n</tool_call>' -}}
    {%- endfor -%}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "so", "vi", "de", "pa", "zu", "fe", "gi", "ho", "ba", "wen")
_ENGLISH = (
    "the", "a", "an", "model", "token", "server", "cache", "batch", "prefix", "slot", "fast", "slow", "queue",
    "answer", "is", "are", "was", "and", "or", "of", "to", "in", "on", "at", "we", "you", "it", "they", "router",
    "engine", "load", "page", "block", "step", "user", "assistant", "system", "question", "tool", "call",
    "function", "name", "value", "please", "what", "how", "why", "when", "with", "for", "this", "that", "be",
    "have", "not", "can", "will", "should", "first", "second", "next", "then", "so", "reply", "prompt",
    "stream", "data", "result", "error", "request", "response", "number", "list", "text", "word", "hello",
    "world", "there", "here", "about", "short", "long", "again", "other", "another", "only", "test",
)
_ACCENTED = ("héllo", "wörld", "café", "naïve", "über", "señor", "☃", "→", "…", "日本", "ça")
_PUNCT = (".", ",", "?", "!", ":", ";", " -", " (", ")", "\"", "'")
_KEYS = ("name", "arguments", "query", "value", "id", "type", "text", "count", "items", "city", "unit")


_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def _word(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.4:
        return "".join(rng.choice(_SYLLABLES) for _ in range(2))[:6]
    if r < 0.65:
        return rng.choice(_ENGLISH)
    if r < 0.88:  # a wider set of made-up words, so the vocabulary fills up with whole words and pieces
        return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
    if r < 0.96:
        return str(rng.randrange(10 ** rng.randint(1, 5)))
    return rng.choice(_ACCENTED)


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 24))]
    out = words[0].capitalize()
    for w in words[1:]:
        out += (rng.choice(_PUNCT) if rng.random() < 0.08 else "") + " " + w
    return out + rng.choice((".", ".", "?", "!", ":"))


def _json_line(rng: random.Random) -> str:
    obj: dict[str, Any] = {}
    for _ in range(rng.randint(1, 4)):
        key = rng.choice(_KEYS)
        kind = rng.random()
        obj[key] = (_word(rng) if kind < 0.5 else rng.randrange(1000) if kind < 0.7
                    else [_word(rng) for _ in range(rng.randint(1, 3))] if kind < 0.85 else {"q": _word(rng)})
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": ") if rng.random() < 0.7 else (",", ":"))


def corpus(seed: int = 20261201, lines: int = 4000) -> list[str]:
    """The training text: seeded sentences, JSON lines and a little layout (newlines, indentation, lists)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        r = rng.random()
        if r < 0.7:
            text = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        elif r < 0.9:
            text = _json_line(rng)
        else:
            text = "\n".join(f"{rng.choice(('-', '*', '1.', '  -'))} {_sentence(rng)}" for _ in range(3))
        out.append(text + ("\n" if rng.random() < 0.3 else ""))
    return out


def tokenizer_json() -> str:
    """``tokenizer.json``: the trained BPE, special tokens added (not normalized, no strip), BOS prepended when
    special tokens are requested (completion prompts), as a Llama-style tokenizer does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
                for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok.to_str(pretty=True)


def tokenizer_config() -> dict[str, Any]:
    return {"sim_tokenizer_version": VERSION, "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": MODEL_MAX_LENGTH,
            "chat_template": CHAT_TEMPLATE}


def _current(directory: Path) -> bool:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(config, dict) and config.get("sim_tokenizer_version") == VERSION
            and (directory / "tokenizer.json").is_file())


def _write(path: Path, text: str) -> None:
    """Atomically, so a concurrent reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def ensure_tokenizer(directory: Path | str) -> Path:
    """The generated tokenizer directory at ``directory``, written there when missing or of another version.
    ``tokenizer_config.json`` is written last: it marks the directory complete."""
    directory = Path(directory)
    if _current(directory):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory / "tokenizer.json", tokenizer_json())
    _write(directory / "tokenizer_config.json", json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n")
    return directory
