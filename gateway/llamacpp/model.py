"""Generate small llama-architecture GGUF models with random weights, for a real ``llama-server`` on a CPU.

    gateway llamacpp model --size tiny|large|agent [--out PATH]      prints the model's path

No model can be downloaded here, so the suite makes its own: random weights from a fixed seed (the output is
gibberish, but the server really tokenizes, prefills, caches prompts, decodes, enforces grammars and
exports metrics), a SentencePiece-style vocabulary with byte fallback, ChatML special tokens and template.

``add_space_prefix`` is false: with a leading-space prefix the generation prompt does not tokenize to the
JSON-schema grammar's literal prefix and llama.cpp fails with "Failed to initialize samplers".
Models are cached next to the llama-server binary and never committed.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.llamacpp.build import cache_dir, cache_lock, staging_path

SEED = 1234
SPACE = "\u2581"  # SentencePiece's word-boundary marker
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>'"
    " + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word"
    " but not what all were we when your can said there use an each which she do how their if will up other"
    " about out many then them these so some her would make like him into time has look two more write go see"
    " number no way could people my than first water been call who oil its now find long down day did get come"
    " made may part model token cache prefix server gateway request stream json value name true false null"
    " list item key string user assistant system answer question hello world story tell me about"
).split()


@dataclass(frozen=True)
class ModelSize:
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_ctx: int


SIZES = {
    # API tests: loads and answers in milliseconds
    "tiny": ModelSize(n_embd=64, n_layer=2, n_ff=128, n_head=4, n_ctx=4096),
    # prefix-cache tests and calibration: prefilling ~2,000 tokens takes a noticeable fraction of a second
    "large": ModelSize(n_embd=256, n_layer=4, n_ff=768, n_head=8, n_ctx=8192),
}
# and "agent": a tool-calling model with a 128k context, its weights set by hand (gateway.llamacpp.agent_model)
MODELS = (*SIZES, "agent")


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types (gguf.TokenType values) of an SPM vocabulary with byte fallback.

    Every word comes with all its prefixes, so SentencePiece's greedy bigram merging can reach it; longer
    pieces score higher, so they win merges.
    """
    import gguf

    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(gguf.TokenType.BYTE)
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    special = len(tokens)
    pieces: set[str] = set(string.ascii_letters + string.digits + string.punctuation)
    pieces.add(SPACE)
    pieces.update(SPACE + c for c in string.ascii_letters + string.digits + string.punctuation)
    for a in string.ascii_lowercase:
        for b in string.ascii_lowercase:
            pieces.add(a + b)
    for word in WORDS:
        for end in range(2, len(word) + 1):
            pieces.add(word[:end])
            pieces.add(SPACE + word[:end])
    pieces.update(['{"', '":', '",', '"}', "\n", "\n\n", " ", "  "])
    ordered = sorted(pieces, key=lambda p: (len(p), p))
    tokens += ordered
    types += [gguf.TokenType.NORMAL] * len(ordered)
    scores = [0.0] * special + [float(len(p)) - i * 1e-4 for i, p in enumerate(ordered)]
    return tokens, scores, [int(t) for t in types]


def generate(path: Path, size: str = "tiny", seed: int = SEED) -> Path:
    if size == "agent":
        from gateway.llamacpp import agent_model

        return agent_model.generate(path)
    import numpy as np

    dims = SIZES[size]
    tokens, scores, types = vocabulary()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weight(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ones = np.ones(dims.n_embd, dtype=np.float32)
    tensors = [("token_embd.weight", weight(n_vocab, dims.n_embd, scale=1.0)), ("output_norm.weight", ones),
               ("output.weight", weight(n_vocab, dims.n_embd))]
    for i in range(dims.n_layer):
        tensors.append((f"blk.{i}.attn_norm.weight", ones))
        tensors += [(f"blk.{i}.{name}.weight", weight(dims.n_embd, dims.n_embd))
                    for name in ("attn_q", "attn_k", "attn_v", "attn_output")]
        tensors += [(f"blk.{i}.ffn_norm.weight", ones), (f"blk.{i}.ffn_gate.weight", weight(dims.n_ff, dims.n_embd)),
                    (f"blk.{i}.ffn_up.weight", weight(dims.n_ff, dims.n_embd)),
                    (f"blk.{i}.ffn_down.weight", weight(dims.n_embd, dims.n_ff))]
    return write(path, f"llm-gateway random {size}", dims, 10000.0, (tokens, scores, types), CHATML_TEMPLATE, tensors)


def write(path: Path, name: str, dims: ModelSize, rope_base: float,
          vocab: tuple[list[str], list[float], list[int]], template: str, tensors: list[tuple[str, Any]]) -> Path:
    """A llama-architecture GGUF at ``path`` (written aside, then moved into place): ``dims``, RoPE base
    ``rope_base``, the SPM ``vocab`` (its end of turn ``<|im_end|>``), its chat ``template`` and ``tensors`` in
    order."""
    import gguf

    tokens, scores, types = vocab
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(path)
    writer = gguf.GGUFWriter(str(staging), "llama")
    writer.add_name(name)
    writer.add_context_length(dims.n_ctx)
    writer.add_embedding_length(dims.n_embd)
    writer.add_block_count(dims.n_layer)
    writer.add_feed_forward_length(dims.n_ff)
    writer.add_head_count(dims.n_head)
    writer.add_head_count_kv(dims.n_head)
    writer.add_rope_dimension_count(dims.n_embd // dims.n_head)
    writer.add_rope_freq_base(rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    im_end = tokens.index("<|im_end|>")
    writer.add_eos_token_id(im_end)
    writer.add_eot_token_id(im_end)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(template)
    for tensor_name, tensor in tensors:
        writer.add_tensor(tensor_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    staging.replace(path)
    return path


def model_path(size: str) -> Path:
    """The cached model of that size (or the agent model), generated on first use."""
    name = "agent-llama-v2.gguf" if size == "agent" else f"random-llama-{size}-s{SEED}-v1.gguf"
    path = cache_dir() / "models" / name
    if not path.exists():
        with cache_lock(name):
            if not path.exists():  # (or another process made it while this one waited)
                generate(path, size)
    return path
