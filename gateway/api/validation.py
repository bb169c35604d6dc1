"""Checks on an OpenAI request body: only what the gateway relies on, each failure a 400 naming the field.

Sampling parameters and the rest are the engine's to judge; its 400 is passed back in the same envelope.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.api.body_head import CHOICE_FIELDS, prompt_count
from gateway.config import LimitSettings
from gateway.engines.sampling import sampler_chain, whole_vocabulary
from gateway.errors import GatewayError
from gateway.routing.request import POOLING_ROUTES, RouteRequest
from gateway.structured import Constraint, ConstraintInvalid, extract, tools_fanout
from gateway.structured.bounds import Offload
from gateway.structured.offload import ValidationBusy, ValidationWorkers

_MAX_DEPTH = 254  # the deepest nesting orjson encodes
# what a request may generate, however an engine spells it (OpenAI chat, completions, llama.cpp)
# (TabbyAPI's max_length is its alias of max_tokens)
OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "n_predict", "max_length")
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _bad(message: str, param: str | None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request")


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(f"'{key}' must be an integer of at least 1, got {orjson.dumps(value).decode()}", key)
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of message objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # (an unhashable role must not raise TypeError)
            raise _bad(f"messages[{i}].role must be one of {', '.join(sorted(_ROLES))}", f"messages[{i}].role")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _bad(f"messages[{i}].content must be a string or an array of content parts",
                       f"messages[{i}].content")


# request fields an engine reads at every token it generates, for every request in the batch (stop strings are
# matched against the text so far; token lists and maps are looked up or applied to the logits)
STOP_FIELDS = ("stop", "stop_sequences", "bad_words", "stop_regex", "dry_sequence_breakers", "banned_strings",
               "stop_sequence")  # (the last: TabbyAPI's alias of stop)
# (TabbyAPI also takes its token lists as one comma-separated string: counted by its commas)
TOKEN_FIELDS = ("logit_bias", "stop_token_ids", "allowed_token_ids", "banned_tokens", "custom_token_bans",
                "allowed_tokens")
MAX_BIAS_KEY = 64  # characters of a logit_bias key (llama.cpp tokenizes a key that is text: one entry a token)


# request fields of an engine's own that the gateway does not pass on from a client, and why (a 400 naming the
# field: dropped, the client would be served as if it had been honoured)
NOT_ACCEPTED = {
    "lora_path": "name the adapter as the model: the key's list of models applies to it (SGLang served the "
                 "adapter a lora_path named, whatever models the key may use)",
    "custom_logit_processor": "it is code the engine runs (SGLang, with --enable-custom-logit-processor)",
    "logits_processors": "it names code the engine loads (vLLM, with --logits-processor-pattern)",
    "session_params": "it continues an engine session by its id, which the gateway cannot tie to a key (SGLang)",
    "session_id": "it continues an engine session by its id, which the gateway cannot tie to a key (SGLang)",
    "input_ids": "the prompt is the messages or prompt the gateway checks, routes and charges; SGLang would "
                 "serve these token ids in their place",
    "lora": "name the adapter as the model: the key's list of models applies to it (llama.cpp's adapters by id)",
    # set by llama.cpp's own chat templates; from a client on /v1/completions a value llama-server does not know
    # aborts the process (an unknown grammar trigger type, an unknown chat format: sweep 20), and a failover took
    # the request, and the abort, to every backend of the model
    "grammar_triggers": "it is set by llama.cpp's chat templates, and an unknown trigger type aborts llama-server",
    "preserved_tokens": "it is set by llama.cpp's chat templates",
    "chat_format": "it is set by llama.cpp's chat templates, and an unknown format aborts llama-server",
    "chat_parser": "it is set by llama.cpp's chat templates",
    "prompt_embeds": "the prompt is the messages or prompt the gateway checks, routes and charges; vLLM would "
                     "serve these embeddings in their place",
    "chat_template": "it is a template the engine runs in place of the model's own: the gateway routes and "
                     "charges the prompt the model's template makes",
    "negative_prompt": "TabbyAPI runs it as a second prompt beside the request's at every token, which the gateway "
                       "neither bounds nor charges (sweep 22: 400,000 characters were charged 16 tokens)",
}
# llama.cpp's sampler settings whose size sets what its main loop does at every token, or at a slot's start, for
# every slot (sweep 20: 2,000 repeated samplers held other keys' streams to 1% of their pace; 20,000 DRY sequence
# breakers held the loop 34 s; a repeat_last_n of 50 million took 670 MB)
MAX_SAMPLERS = 16  # llama.cpp has about a dozen, each once
# DRY sequence breakers: llama.cpp reads the whole vocabulary for each when a request starts (~8 ms each with a
# 128k vocabulary: 32 of them, at 4 requests a second, held other keys' requests from 0.25 to 6.6 s, sweep 22; 8
# still tripled another key's p50 at 10 a second, sweep 23): as many as its default has
MAX_DRY_BREAKERS = 4
MAX_LAST_N = 131_072  # repeat_last_n, dry_penalty_last_n (-1: the context; 0: off)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound (vLLM's default max_logprobs); n_probs is llama.cpp's spelling


# Request fields an engine's own prefill/decode router sets, never a client: vLLM's kv_transfer_params (where
# a decode instance pulls the prompt's KV blocks from: host, port, block ids) and SGLang's bootstrap_* (the
# same for its disaggregated mode). From a client, on an engine run with a KV connector, they would steer its
# transfers to another request's blocks or to any host; they reach no engine (taken out of the body here, once)
SERVING_SYSTEM_FIELDS = frozenset({"kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"})


def _check_not_accepted(body: dict[str, Any]) -> None:
    for field, why in NOT_ACCEPTED.items():
        if body.get(field) is not None:
            raise GatewayError(400, f"'{field}' is not accepted through this gateway: {why}", param=field,
                               code="unsupported_parameter")


def _check_per_token(body: dict[str, Any], limits: LimitSettings) -> None:
    chars = 0
    for field in STOP_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad(f"'{field}' must be a string or an array of strings", field)
        if len(stops) > limits.max_stop:
            raise _bad(f"'{field}' has {len(stops)} entries; this gateway accepts at most {limits.max_stop}", field)
        chars += sum(map(len, stops))
        if chars > limits.max_stop_chars:
            raise _bad(f"the stop sequences hold more than {limits.max_stop_chars} characters in all", field)
    for field in TOKEN_FIELDS:
        value = body.get(field)
        entries = (len(value) if isinstance(value, list | dict) else value.count(",") + 1 if isinstance(value, str)
                   else 0)
        if entries > limits.max_token_entries:
            raise _bad(f"'{field}' has {entries} entries; this gateway accepts at most "
                       f"{limits.max_token_entries}", field)
        if isinstance(value, dict) and any(len(k) > MAX_BIAS_KEY for k in value):
            raise _bad(f"'{field}' has a key of more than {MAX_BIAS_KEY} characters", field)
    bias = body.get("logit_bias")  # (llama.cpp also takes it as [[token or text, bias], ...])
    if isinstance(bias, list) and any(isinstance(pair, list) and pair and isinstance(pair[0], str)
                                      and len(pair[0]) > MAX_BIAS_KEY for pair in bias):
        raise _bad(f"'logit_bias' has a key of more than {MAX_BIAS_KEY} characters", "logit_bias")
    samplers = body.get("samplers")
    chain = (sampler_chain(samplers) if isinstance(samplers, str | list) and len(samplers) <= MAX_SAMPLERS
             else None)
    if samplers is not None and (chain is None or len(set(chain)) != len(chain)):
        # (each once, however spelt: the chain runs every entry over the candidates at every token; 16 typical
        # samplers, each sorting a 128k vocabulary, held other keys' streams to 2% of their pace: sweep 21)
        raise _bad(f"'samplers' must be a string or an array of at most {MAX_SAMPLERS} samplers, each once",
                   "samplers")
    if chain is not None and "i" in chain:
        # (llama.cpp's fill-in-the-middle sampler, which its /infill sets: its cost is the square of the
        # candidates, at every token, on the loop every slot shares: 7.4 s a token at top_k 16,000, sweep 22)
        raise _bad("'samplers' may not name infill: llama.cpp's /infill route sets it", "samplers")
    breakers = body.get("dry_sequence_breakers")
    if isinstance(breakers, str):  # (TabbyAPI reads a string as the inside of a JSON array)
        try:
            parsed = orjson.loads("[" + breakers + "]")
        except orjson.JSONDecodeError:
            parsed = [breakers]
        breakers = parsed if isinstance(parsed, list) else [breakers]
    if isinstance(breakers, list) and len(breakers) > MAX_DRY_BREAKERS:
        raise _bad(f"'dry_sequence_breakers' has {len(breakers)} entries; this gateway accepts at most "
                   f"{MAX_DRY_BREAKERS}", "dry_sequence_breakers")
    for field, low, high in (("repeat_last_n", -1, MAX_LAST_N), ("dry_penalty_last_n", -1, MAX_LAST_N),
                             ("penalty_range", -1, MAX_LAST_N), ("rep_pen_range", -1, MAX_LAST_N),
                             ("repetition_range", -1, MAX_LAST_N), ("repetition_penalty_range", -1, MAX_LAST_N),
                             ("dry_range", -1, MAX_LAST_N),
                             ("top_logprobs", 0, MAX_TOP_LOGPROBS), ("n_probs", 0, MAX_TOP_LOGPROBS)):
        value = body.get(field)
        if value is not None and (type(value) is not int or not low <= value <= high):
            raise _bad(f"'{field}' must be an integer from {low} to {high}", field)
    for field in ("min_tokens", "min_length"):  # (generated at least: reserved as the most, see body_head)
        value = body.get(field)
        if value is not None and (type(value) is not int or not 0 <= value <= limits.max_tokens):
            raise _bad(f"'{field}' must be an integer from 0 to {limits.max_tokens}", field)
    logprobs = body.get("logprobs")  # (an integer on completions: how many; llama.cpp reads any number as n_probs)
    if (isinstance(logprobs, int | float) and not isinstance(logprobs, bool)
            and (type(logprobs) is not int or not 0 <= logprobs <= MAX_TOP_LOGPROBS)):
        raise _bad(f"'logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", "logprobs")


def _check_tools(tools: Any, limits: LimitSettings) -> None:
    if tools is None:
        return
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise _bad("'tools' must be an array of tool objects", "tools")
    if len(tools) > limits.max_tools:
        raise _bad(f"'tools' has {len(tools)} entries; this gateway accepts at most {limits.max_tools}", "tools")


def _check_prompt(prompt: Any, limits: LimitSettings) -> None:
    if isinstance(prompt, list) and len(prompt) > limits.max_inputs and isinstance(prompt[0], str | list):
        raise _bad(f"'prompt' holds {len(prompt)} prompts; this gateway accepts at most {limits.max_inputs}",
                   "prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and (
        all(isinstance(p, str) for p in prompt)
        or all(isinstance(p, int) and not isinstance(p, bool) for p in prompt)
        or all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt)
    ):
        return
    raise _bad("'prompt' must be a string, an array of strings, or an array of token ids", "prompt")


def _check_input(value: Any, limits: LimitSettings) -> None:
    if isinstance(value, list) and len(value) > limits.max_inputs:
        raise _bad(f"'input' has {len(value)} entries; this gateway accepts at most {limits.max_inputs}", "input")
    if isinstance(value, str) or (isinstance(value, list) and value):
        return
    raise _bad("'input' must be a string or a non-empty array", "input")


def _check_rerank(body: dict[str, Any], limits: LimitSettings) -> None:
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise _bad("'query' is required and must be a non-empty string", "query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise _bad("'documents' must be a non-empty array of strings (or of objects with a 'text' string)",
                   "documents")
    if len(documents) > limits.max_documents:
        raise _bad(f"'documents' has {len(documents)} entries; this gateway accepts at most "
                   f"{limits.max_documents}", "documents")
    for i, document in enumerate(documents):
        if not isinstance(document, str) and not (isinstance(document, dict)
                                                  and isinstance(document.get("text"), str)):
            raise _bad(f"documents[{i}] must be a string or an object with a 'text' string", f"documents[{i}]")
    _positive_int(body, "top_n")


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object: one C-level parse, bounded by ``server.max_body_bytes`` before it.
    Nothing else is checked here: the key's checks come next, then :func:`parse_body`."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"We could not parse the JSON body of your request: {exc}", None) from None
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object", None)
    return body


def requested_model(body: dict[str, Any]) -> str:
    """The model the body names (what a key's allow-list is checked against), or a 400."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required and must be a non-empty string", "model")
    return model


def check_depth(body: dict[str, Any], limits: LimitSettings | None, constraints: bool = True) -> None:
    """A 400 for a body nesting deeper than the gateway can re-encode: orjson reads 1,024 levels but writes
    only 254, and a body between the two would fail later, wherever the gateway re-encodes it (prompt keys,
    the upstream request, an agent API's translation). ~0.1 us for a small body."""
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError as exc:
        if constraints:  # (a chat or completions body)
            _constraint(body, limits)  # a constraint nested too deep is refused as such, naming its field
        raise _bad(f"The request body cannot be accepted: {exc} (it nests deeper than {_MAX_DEPTH} levels)",
                   None) from None


def parse_body(route: str, body: dict[str, Any], limits: LimitSettings | None = None) -> RouteRequest:
    """The checks the gateway relies on, on a decoded body whose key passed its checks; a 400 naming the field
    for the first that fails."""
    check_depth(body, limits, route not in POOLING_ROUTES)
    model = requested_model(body)
    limits = limits or LimitSettings()
    if route == "chat":
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > limits.max_messages:  # (counted before any is read)
            raise _bad(f"'messages' has {len(messages)} entries; this gateway accepts at most "
                       f"{limits.max_messages}", "messages")
        _check_messages(messages)
    elif route == "completions":
        _check_prompt(body.get("prompt"), limits)
    elif route == "rerank":
        _check_rerank(body, limits)
    else:
        _check_input(body.get("input"), limits)
    _check_tools(body.get("tools"), limits)
    _check_not_accepted(body)
    for field in SERVING_SYSTEM_FIELDS:
        body.pop(field, None)
    if route not in POOLING_ROUTES:
        _check_per_token(body, limits)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    if route in POOLING_ROUTES and stream:
        raise _bad(f"{route} cannot be streamed", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise _bad("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
    generations = 1  # the sequences the engine generates for it: each choice of each prompt
    for key in CHOICE_FIELDS:  # (each choice is a sequence the engine generates: n=10^9 was passed on)
        choices = _positive_int(body, key)
        if choices is not None and choices > limits.max_n:
            raise _bad(f"'{key}' is {choices}; this gateway accepts at most {limits.max_n}", key)
        generations = max(generations, choices or 1)
    if route == "completions":
        generations *= prompt_count(body.get("prompt"))
    # Engines read different fields (TabbyAPI max_tokens, llama.cpp n_predict before max_tokens): each is bounded,
    # and the request may generate the most any of them says.
    max_tokens: int | None = None
    for field in OUTPUT_FIELDS:
        value = _positive_int(body, field)
        if value is not None and value > limits.max_tokens:
            raise _bad(f"'{field}' is {value}; this gateway accepts at most {limits.max_tokens}", field)
        if value is not None:
            max_tokens = max(max_tokens or 0, value)
    constraint = _constraint(body, limits) if route not in POOLING_ROUTES else None
    fanout = constraint.fanout if constraint is not None else None
    tools_pending = False
    if body.get("tools") and route not in POOLING_ROUTES:
        try:  # (bounded like any constraint; llama.cpp compiles every tool into a lazy grammar)
            fanout = fanout or tools_fanout(body["tools"], limits, inline=True)
        except Offload:  # (too much for the event loop: validate_heavy has a worker check them)
            tools_pending = True
        except ConstraintInvalid as exc:
            raise GatewayError(400, str(exc), param=exc.param, code=exc.code) from None
    return RouteRequest(route=route, model=model, stream=stream, max_tokens=max_tokens, body=body,
                        constraint=constraint, generations=generations,
                        whole_vocabulary=whole_vocabulary(body) if route not in POOLING_ROUTES else None,
                        fanout=fanout, tools_pending=tools_pending)


def _constraint(body: dict[str, Any], limits: LimitSettings | None) -> Constraint | None:
    try:
        return extract(body, limits)
    except ConstraintInvalid as exc:
        raise GatewayError(400, str(exc), param=exc.param, code=exc.code) from None


async def validate_heavy(request: RouteRequest, workers: ValidationWorkers, owner: str) -> None:
    """Finish what ``parse_body`` left to a worker process: validating a constraint too big to validate on
    the event loop (``Constraint.pending``), in ``owner``'s (the API key's) fair share of the workers. Returns
    at once for every other request."""
    constraint = request.constraint
    if (constraint is None or constraint.pending is None) and not request.tools_pending:
        return
    try:
        if constraint is not None and constraint.pending is not None:
            request.constraint = await workers.validate(constraint, owner)
            request.fanout = request.fanout or request.constraint.fanout
        if request.tools_pending:
            fanout = await workers.validate_tools(request.body["tools"], owner)
            request.tools_pending = False
            request.fanout = request.fanout or fanout
    except ConstraintInvalid as exc:
        raise GatewayError(400, str(exc), param=exc.param, code=exc.code) from None
    except ValidationBusy as exc:
        raise GatewayError(503, str(exc), code="validation_busy", headers={"retry-after": "1"}) from None
