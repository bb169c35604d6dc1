"""The generated tokenizer directory (deterministic, fast, a Hugging Face layout), the emulators' loader and chat
template rendering (transformers' jinja environment, vLLM's request preparation), chat versus completion special
tokens, and emulated servers that count, cache and tokenize with it."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest

from gateway.sim import FleetThread, SimSpec
from gateway.sim.hf_tokenizer import HFTokenizer, prepare_tools
from gateway.sim.tokenizer_files import SPECIAL_TOKENS, VERSION, ensure_tokenizer, tokenizer_json
from tests.sim.conftest import ask_usage

pytestmark = pytest.mark.unit

MODEL = "m"
SYSTEM = "You are assistant seven." + " kalo mine ruta wenso bade fezu" * 10


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> HFTokenizer:
    return HFTokenizer.from_dir(tokenizer_dir)


def messages(user: Any = "hello there", system: str = SYSTEM) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# -- the generated directory ------------------------------------------------------------------------------------
@pytest.mark.system
def test_generation_is_deterministic_across_processes(tokenizer_dir: Path) -> None:
    text = tokenizer_json()
    assert (tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8") == text
    code = ("import hashlib; from gateway.sim.tokenizer_files import tokenizer_json; "
            "print(hashlib.sha256(tokenizer_json().encode()).hexdigest())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"})
    assert other.stdout.strip() == hashlib.sha256(text.encode()).hexdigest()


def test_the_directory_is_a_hugging_face_layout(tokenizer_dir: Path, hf: HFTokenizer) -> None:
    doc = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    added = {t["content"]: t for t in doc["added_tokens"]}
    assert set(added) == set(SPECIAL_TOKENS)
    for token in added.values():
        assert (token["special"], token["normalized"], token["lstrip"], token["rstrip"]) == (True, False, False, False)
    assert doc["pre_tokenizer"]["type"] == "ByteLevel" and doc["decoder"]["type"] == "ByteLevel"
    assert 4000 <= hf.tokenizer.get_vocab_size() <= 8000
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "</s>")
    assert config["chat_template"].startswith("{{- bos_token") and config["model_max_length"] >= 4096
    text = "any text at all: 日本語 🎉 \t\n{\"k\": [1, 2]}"
    assert hf.decode(hf.encode(text, add_special_tokens=False)) == text, "byte-level: every input encodes"
    assert len(hf.encode(" kalo mine ruta wenso bade fezu", add_special_tokens=False)) == 6, "a word a token"


def test_ensure_rewrites_another_version_only(tmp_path: Path) -> None:
    target = ensure_tokenizer(tmp_path / "tok")
    assert target == tmp_path / "tok"
    stamp = (target / "tokenizer.json").stat().st_mtime_ns
    assert ensure_tokenizer(target) == target and (target / "tokenizer.json").stat().st_mtime_ns == stamp
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "sim_tokenizer_version": "old"}))
    (target / "tokenizer.json").write_text("{}")
    ensure_tokenizer(target)
    assert json.loads((target / "tokenizer_config.json").read_text())["sim_tokenizer_version"] == VERSION
    assert HFTokenizer.from_dir(target).encode("hello") == HFTokenizer.from_dir(target).encode("hello")


def test_the_cli_writes_the_directory(tmp_path: Path) -> None:
    from gateway.sim.cli import main

    assert main(["tokenizer", "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "tokenizer.json").is_file() and (tmp_path / "cli" / "tokenizer_config.json").is_file()


# -- loading and rendering --------------------------------------------------------------------------------------
def test_the_chat_template_renders_every_role_tools_and_tool_calls(hf: HFTokenizer) -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": json.dumps({"city": "Zürich"})}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert hf.render(conversation, tools) == (
        "<s><|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n"
        '{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}\n'
        "</tools><|im_end|>\n"
        "<|im_start|>user\npart one\npart two<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert hf.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<s><|im_start|>user\nhi<|im_end|>\n")
    with pytest.raises(jinja2.TemplateError, match="Unsupported role"):
        hf.render([{"role": "narrator", "content": "x"}])


def test_tools_reach_the_template_as_each_engine_dumps_them(tokenizer_dir: Path) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x": 1}}]
    assert prepare_tools(tools) == [{"type": "function", "function": {"name": "f", "description": None,
                                                                      "parameters": {"type": "object"}, "x": 1}}]
    assert prepare_tools(tools, "sglang") == [{"description": None, "name": "f", "parameters": {"type": "object"},
                                               "strict": False}]
    assert prepare_tools(tools, "sglang", tool_choice="none") is None and prepare_tools(None) is None
    sglang = HFTokenizer.from_dir(tokenizer_dir, "sglang")
    assert '\n{"description": null, "name": "f"' in sglang.render([{"role": "user", "content": "q"}], tools)


def test_the_loader_follows_transformers_layout(tmp_path: Path, tokenizer_dir: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    template = ("{{ bos_token }}{% for m in messages %}{% generation %}[{{ m['content'] }}]{% endgeneration %}"
                "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ eos_token }}{{ x | default('') }}")
    config = {"bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                            "single_word": False, "__type": "AddedToken"}, "eos_token": "</s>",
              "chat_template": [{"name": "tool_use", "template": "no"}, {"name": "default", "template": template}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    three = [{"role": "user", "content": c} for c in "abc"]
    loaded = HFTokenizer.from_dir(tmp_path)
    assert loaded.render(three, x="!") == "<s>[a][b]</s>!"
    assert loaded.eos_id == loaded.tokenizer.token_to_id("</s>")
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}{{ {'é': 1} | tojson }}")
    assert HFTokenizer.from_dir(tmp_path).render(three) == '3{"é": 1}', "chat_template.jinja wins; tojson keeps é"


def test_chat_prompts_carry_the_templates_bos_and_completions_the_tokenizers(hf: HFTokenizer) -> None:
    bos = hf.tokenizer.token_to_id("<s>")
    chat = hf.chat_ids(messages())
    assert chat[0] == bos and chat[1] != bos, "exactly one BOS: the template's"
    assert chat == hf.encode(hf.render(messages()), add_special_tokens=False)
    assert hf.encode("kalo mine") == [bos, *hf.encode("kalo mine", add_special_tokens=False)]
    assert hf.tokenizer.token_to_id("<|im_start|>") in chat, "special tokens in the text are single tokens"
    pieces, ids = hf.pieces("héllo wörld ☃ 12")
    assert "".join(pieces) == "héllo wörld ☃ 12" and ids == hf.encode("héllo wörld ☃ 12", add_special_tokens=False)


# -- emulated servers with the tokenizer ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(tokenizer_dir: Path) -> Any:
    specs = [SimSpec(engine=e, model=MODEL, name=e, time_scale=100.0, tokenizer=str(tokenizer_dir))  # type: ignore[arg-type]
             for e in ("vllm", "sglang", "llamacpp", "tabbyapi")]
    with FleetThread(specs) as ft:
        yield ft


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp", "tabbyapi"])
def test_usage_counts_the_models_tokens(fleet: Any, tokenizer_dir: Path, hf: HFTokenizer, engine: str) -> None:
    server = fleet.fleet[engine]
    conversation = messages("what is the answer?")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=5,
                   json={"model": MODEL, "messages": conversation, "tools": tools, "max_tokens": 7,
                         "ignore_eos": True, **ask_usage(engine)})
    assert r.status_code == 200, r.text
    body = r.json()
    model = HFTokenizer.from_dir(tokenizer_dir, "sglang" if engine == "sglang" else "vllm")
    assert body["usage"]["prompt_tokens"] == len(model.chat_ids(conversation, tools))
    text = body["choices"][0]["message"]["content"]
    assert len(hf.encode(text, add_special_tokens=False)) == body["usage"]["completion_tokens"] == 7
    prompt = "kalo mine ruta 12 34"
    r = httpx.post(server.url + "/v1/completions", timeout=5,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2, **ask_usage(engine)})
    assert r.json()["usage"]["prompt_tokens"] == len(hf.encode(prompt))


@pytest.mark.integration
def test_vllm_tokenize_and_detokenize(fleet: Any, hf: HFTokenizer) -> None:
    url = fleet.fleet["vllm"].url
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    body = {"model": MODEL, "messages": messages("héllo ☃"), "tools": tools}
    out = httpx.post(url + "/tokenize", json=body, timeout=5).json()
    assert out["tokens"] == hf.chat_ids(body["messages"], tools) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] > 0
    with_bos = httpx.post(url + "/tokenize", json={**body, "add_special_tokens": True}, timeout=5).json()["tokens"]
    assert with_bos == [hf.tokenizer.token_to_id("<s>"), *out["tokens"]]
    prompt = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": "kalo mine"}, timeout=5).json()
    assert prompt["tokens"] == hf.encode("kalo mine")
    text = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": prompt["tokens"]}, timeout=5).json()
    assert text == {"prompt": "kalo mine"}
    refused = httpx.post(url + "/v1/chat/completions", timeout=5,
                         json={"model": MODEL, "messages": [{"role": "narrator", "content": "x"}]})
    assert refused.status_code == 400 and "Unsupported role" in refused.text


@pytest.mark.integration
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_cache_holds_the_models_ids_of_prompt_and_answer(fleet: Any, hf: HFTokenizer, engine: str) -> None:
    """After a request the prefix cache holds the prompt's ids and the answer's, both as the model tokenizes
    them: the next turn of the conversation reuses them."""
    server = fleet.fleet[engine]
    server.scheduler.cache.flush()
    conversation = messages("tell me more", system="A fresh system prompt." + " zuba feso" * 30)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=5,
                   json={"model": MODEL, "messages": conversation, "max_tokens": 40, "ignore_eos": True})
    answer = r.json()["choices"][0]["message"]["content"]
    ids = hf.chat_ids(conversation) + hf.encode(answer, add_special_tokens=False)
    unit = 16 if engine == "vllm" else 1
    assert server.scheduler.cache.held(ids) == len(ids) // unit * unit
    follow = [*conversation, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
    usage = httpx.post(server.url + "/v1/chat/completions", timeout=5,
                       json={"model": MODEL, "messages": follow, "max_tokens": 2}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= len(ids) // unit * unit - unit
