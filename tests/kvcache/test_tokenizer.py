"""Prompts as token ids: the chat template rendered as transformers renders it, text between special tokens
tokenized once, long prompts bounded."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gateway.kvcache.tokenizer import MIN_TAIL, PromptTokenizer, TokenizerError

pytestmark = pytest.mark.unit


def whole(model_dir: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_chat_renders_like_transformers_and_tokenizes_without_added_specials(model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(model_dir)
    body = {"messages": [{"role": "system", "content": "the lazy dog"},
                         {"role": "user", "content": [{"type": "text", "text": "quick"},
                                                      {"type": "text", "text": "fox"}]}],
            "tools": [{"type": "function", "function": {"name": "wörld"}}]}
    rendered = ("<s><|im_start|>system\nthe lazy dog<|im_end|>\n<|im_start|>user\nquick\nfox<|im_end|>\n"
                '<|im_start|>tools\n[{"type": "function", "function": {"name": "wörld", "description": null, '
                '"parameters": null}}]<|im_end|>\n'
                "<|im_start|>assistant\n")
    assert tok.chat(body) == whole(model_dir, rendered)


def test_text_between_special_tokens_is_tokenized_once(model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(model_dir)
    system = {"role": "system", "content": "the quick brown fox " * 50}
    for user in ("jumps", "over", "the lazy dog"):
        tok.chat({"messages": [system, {"role": "user", "content": user}]})
    misses = tok.cache_misses
    tok.chat({"messages": [system, {"role": "user", "content": "jumps"}]})
    assert tok.cache_misses == misses and tok.cache_hits > 0


def test_long_prompts_are_routed_on_their_first_max_chars(model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(model_dir, max_chars=1024)
    long = "the quick brown fox " * 500
    ids = tok.chat({"messages": [{"role": "user", "content": long}]})
    assert ids is not None
    full = whole(model_dir, f"<s><|im_start|>user\n{long}<|im_end|>\n<|im_start|>assistant\n")
    assert len(ids) < 1024 and ids == full[: len(ids)]  # a prefix of the real prompt's ids
    completion = tok.completion(long)
    assert completion is not None and len(completion) < 1024
    assert tok.completion(["not", "text"]) is None


def test_a_template_that_refuses_gives_none(model_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json",):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    tok = PromptTokenizer.from_dir(tmp_path)
    assert tok.chat({"messages": [{"role": "user", "content": "x"}]}) is None
    assert tok.chat({"messages": "nope"}) is None


def test_a_directory_without_a_usable_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        PromptTokenizer.from_dir(tmp_path)


def test_a_completion_prompt_is_tokenized_with_the_tokenizers_specials_and_cut_at_max_chars(model_dir: Path) -> None:
    tok = PromptTokenizer.from_dir(model_dir, max_chars=1024)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = "the lazy dog " * 70  # 910 characters: under the bound, nothing dropped
    assert tok.completion(text) == raw.encode(text).ids
    long = text * 2  # 1,820: routed on its first 1,024 characters, less the tokens of a possibly cut word
    assert tok.completion(long) == raw.encode(long[:1024]).ids[:-MIN_TAIL]
