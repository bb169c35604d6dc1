"""A generated GGUF model that behaves like a tool-calling agent model on a real ``llama-server``.

Random weights never call a tool: llama-server's tool grammar is lazy (it waits for the model to write the
call's opening tag), and a random model does not write it. So this model's weights are set by hand, as a
small program that a real llama-server runs like any other model:

* it reasons first (``I will look at it``, between ``<think>`` tags, unless the request turns thinking off:
  ``chat_template_kwargs: {"enable_thinking": false}``), then calls a tool when the request offers tools, and
  answers in text once a tool's result is in its context, or when no tool is offered (``answer from the
  call.``);
* it writes the call in the Hermes format its chat template declares (``<tool_call>\\n{"name": ..., "arguments":
  ...}\\n</tool_call>``, with reasoning in ``<think>`` tags: the formats of Qwen3 and many others), so llama.cpp's
  own template analysis finds them, builds the call's grammar from the tools' JSON schemas, and parses the
  answer into ``reasoning_content`` and ``tool_calls``;
* which tool, and the arguments, are the grammar's doing: the model prefers closing a string or an object to
  anything else, so it picks a tool (the same one for the same tools) and gives each required argument the
  shortest value its schema allows.

How: one layer. Every token's embedding holds a constant direction, so every position's query is the same;
two attention heads look for a marker token the template writes (``<tools>`` when tools are offered,
``<tool_response>`` around a tool's result) and write a feature into the residual stream when it is anywhere in
the context. Their query and key use the last dimension pair of a head, which with a huge RoPE base does not
rotate: the match does not depend on how far back the marker is. The feed-forward block is zero. The output
layer then reads the current token and the two features: after the generation prompt's newline, the reasoning;
after the reasoning, a call's opening tag with the tools feature, the answer's first word with the tool-result
feature or without tools; the reasoning's and the answer's words follow one another; everything else scores
by a fixed preference (closing quotes and brackets, then the end of the turn, highest).

It really runs: llama-server tokenizes, prefills 128k-token contexts, constrains the call by its grammar and
streams it as ``tool_calls`` deltas, so an agent client (Claude Code, Codex, the Agents SDK) completes a tool
round trip through the gateway on real llama.cpp.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from gateway.llamacpp.model import SEED, SPACE, ModelSize, vocabulary, write

N_EMBD, N_HEAD, N_CTX = 64, 4, 131072
HEAD = N_EMBD // N_HEAD
ANSWER = ["answer", SPACE + "from", SPACE + "the", SPACE + "call", "."]  # its text answer, one token a word
THOUGHT = ["I", SPACE + "will", SPACE + "look", SPACE + "at", SPACE + "it"]  # its reasoning, between <think> tags
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>", "<think>",
           "</think>"]

# The Hermes tool-call format with reasoning in <think> tags, as Qwen3's template writes them (llama.cpp's autoparser
# recognises both); the reasoning of the turns since the last user message is kept.
TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call functions to answer.\n\nThe functions, within <tools></tools> tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nTo call a function, return its name and arguments as a JSON object within " }}
    {{- "<tool_call></tool_call> tags:\n<tool_call>\n" }}
    {{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query and message.reasoning_content is defined and message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {%- if message.content %}
            {{- message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# what the model prefers where nothing else decides (inside the call's JSON, under its grammar): a string or an
# object closed as soon as the grammar lets it, then the end of the call and of the turn
PREFERENCE = {'"': 10.0, '":': 9.0, "<|im_end|>": 7.0, "</tool_call>": 6.5, "}": 5.5, '"}': 5.0, "]": 5.0, "0": 3.0,
              ":": 3.0, '{"': 2.0, ",": 1.0, "{": 1.0}
OTHERS = -2.0  # every other token's preference (plus a fixed jitter below 0.5, so that ties are broken alike)
STEP = 20.0  # the reasoning's and the answer's words, the call's opening tag to its newline: one after the other
# after the reasoning (or the prompt's closed, empty reasoning when thinking is off): the answer, unless the tools
CALL, ANSWER_FIRST = 16.0, 18.0  # feature adds to the call (both above every PREFERENCE, so neither is a quote)
TOOLS = 6.0  # (16 + 6 > 18; alone, 6 - 2 stays below the end of the turn: no call after a call)
ANSWERED_CALL, ANSWERED_ANSWER = -30.0, 12.0  # a tool's result in the context: no call, the answer


def generate(path: Path) -> Path:
    import gguf
    import numpy as np

    tokens, scores, types = vocabulary()
    for marker in MARKERS:  # (written by the template, read as one token each)
        tokens.append(marker)
        scores.append(0.0)
        types.append(int(gguf.TokenType.USER_DEFINED))
    index = {token: i for i, token in enumerate(tokens)}
    n_vocab = len(tokens)
    basis = np.eye(N_EMBD, dtype=np.float32)
    constant, answered_key, answered, tools_key, tools = basis[0], basis[1], basis[2], basis[4], basis[3]
    steered = ["\n", "\n\n", "<tool_call>", "<think>", "</think>", *THOUGHT, *ANSWER]
    own = {token: basis[8 + i] for i, token in enumerate(steered)}

    embedding = np.zeros((n_vocab, N_EMBD), np.float32)
    embedding[:, 0] = 1.0  # the constant direction
    for token, direction in own.items():
        embedding[index[token]] += direction
    embedding[index["<tool_response>"]] += answered_key
    embedding[index["<tools>"]] += tools_key

    output = np.zeros((n_vocab, N_EMBD), np.float32)
    output[:, 0] = OTHERS + np.random.default_rng(SEED).uniform(0.0, 0.5, n_vocab).astype(np.float32)
    for token, preference in PREFERENCE.items():
        output[index[token], 0] = preference
    output[index["\n"]] += STEP * own["<tool_call>"]  # (the newline a call's grammar wants after its tag)
    chain = ["\n", "<think>", *THOUGHT, "</think>"], [*ANSWER, "<|im_end|>"]  # (the prompt ends in a newline)
    for words in chain:
        for word, following in pairwise(words):
            output[index[following]] += STEP * own[word]
    decided = own["</think>"] + own["\n\n"]  # (after the reasoning, or the closed empty one thinking off)
    output[index["<tool_call>"]] += CALL * decided + TOOLS * tools + ANSWERED_CALL * answered
    output[index[ANSWER[0]]] += ANSWER_FIRST * decided + ANSWERED_ANSWER * answered

    # head 0 finds <tool_response>, head 1 <tools>; each writes its feature (~1: the marker's normalised value,
    # 8/sqrt(2) = 5.66, scaled back) wherever the marker is in the context
    q, k, v, o = (np.zeros((N_EMBD, N_EMBD), np.float32) for _ in range(4))
    for head, key, feature in ((0, answered_key, answered), (1, tools_key, tools)):
        last = (head + 1) * HEAD - 1  # (the last pair of the head: RoPE base 1e30 does not turn it)
        q[last] = 6.0 * constant
        k[last] = 6.0 * key
        v[head * HEAD] = key
        o[:, head * HEAD] = feature / 5.66

    ones = np.ones(N_EMBD, np.float32)
    tensors = [("token_embd.weight", embedding), ("output_norm.weight", ones), ("output.weight", output),
               ("blk.0.attn_norm.weight", ones),
               *((f"blk.0.{name}.weight", tensor) for name, tensor in (("attn_q", q), ("attn_k", k), ("attn_v", v),
                                                                        ("attn_output", o))),
               ("blk.0.ffn_norm.weight", ones),
               *((f"blk.0.{name}.weight", np.zeros((N_EMBD, N_EMBD), np.float32))
                 for name in ("ffn_gate", "ffn_up", "ffn_down"))]
    dims = ModelSize(n_embd=N_EMBD, n_layer=1, n_ff=N_EMBD, n_head=N_HEAD, n_ctx=N_CTX)
    # (a RoPE base of 1e30: the heads' last dimension pair does not turn, see above)
    return write(path, "llm-gateway agent", dims, 1e30, (tokens, scores, types), TEMPLATE, tensors)
