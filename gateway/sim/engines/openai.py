"""OpenAI routes shared by the four engines: request parsing and the default (vLLM-like) response shapes.

Engines override the shape methods (``usage``, ``token_chunk``, ``head_events``, ``tail_events``,
``full_response``) and the request hooks (``constraint``, ``check_model``) where their servers differ.
"""

from __future__ import annotations

import hashlib
import math
import struct
from functools import cached_property
from typing import TYPE_CHECKING, Any

from gateway.sim.agent import ToolPick, pick_tool, reasoning_words, thinking_enabled
from gateway.sim.agent_routes import AgentRoutes, AgentSpec
from gateway.sim.engines.base import _MARK, Engine, EngineError, Event, Gen, Handler, drive, new_id
from gateway.sim.generation import Constraint, Plan, plan_output, request_rng
from gateway.sim.http import Request, Responder
from gateway.sim.rerank import PATHS as RERANK_PATHS
from gateway.sim.rerank import RerankShape, answer, parse, rank
from gateway.sim.scheduler import ContextTooLong
from gateway.sim.template import content_text, render_chat

if TYPE_CHECKING:
    from gateway.sim.hf_tokenizer import HFTokenizer

EMBED_DIM = 256


class OpenAIEngine(Engine):
    reasoning_key = "reasoning"  # the message / delta field of a reasoning model's thinking
    tool_id_prefix = "chatcmpl-tool-"
    agent_spec: AgentSpec | None = None  # the agent routes (Responses, Messages) the engine serves natively
    rerank_shape: RerankShape | None = None  # the engine's rerank routes and answer (None: it has none)

    # -- agent routes ------------------------------------------------------------------------------------------
    @cached_property
    def agent_api(self) -> AgentRoutes | None:
        if self.agent_spec is None:
            return None
        return AgentRoutes(self, self.agent_spec)

    def agent_routes(self) -> dict[tuple[str, str], Handler]:
        return self.agent_api.routes() if self.agent_api is not None else {}

    def rerank_routes(self) -> dict[tuple[str, str], Handler]:
        shape = self.rerank_shape
        if shape is None:
            return {}
        methods = ("POST", "PUT") if shape == "sglang" else ("POST",)  # SGLang: @app.api_route POST and PUT
        return {(method, path): self.rerank for path in RERANK_PATHS[shape] for method in methods}

    def match_route(self, method: str, path: str) -> Handler | None:
        return self.agent_api.match(method, path) if self.agent_api is not None else None

    # -- request hooks -----------------------------------------------------------------------------------------
    def constraint(self, body: dict[str, Any], kind: str) -> Constraint | None:
        """The constraint the engine reads from ``body`` of a request of ``kind`` (chat, completion, native),
        from exactly the fields the engine reads there: any other is ignored, as the engine ignores it."""
        return None

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        value = body.get("max_completion_tokens", body.get("max_tokens"))
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise EngineError(400, f"max_tokens must be at least 1, got {value}.", param="max_tokens")
        return value

    def context_room(self, prompt_len: int, max_tokens: int | None) -> int | None:
        """The output a request may have: ``max_tokens`` (the context is checked against prompt plus it, in the
        scheduler); llama.cpp's differs."""
        return max_tokens

    def context_error(self, exc: ContextTooLong, prompt_len: int, max_tokens: int | None) -> EngineError:
        return EngineError(400, f"This model's maximum context length is {self.server.profile.context_length} "
                           f"tokens. However, you requested {prompt_len + (max_tokens or 0)} tokens "
                           f"({prompt_len} in the messages, {max_tokens or 0} in the completion). Please "
                           "reduce the length of the messages or completion.")

    # -- handlers ----------------------------------------------------------------------------------------------
    async def chat(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        self.check_model(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EngineError(400, "'messages' must be a non-empty list", param="messages")
        hf = self.server.hf
        if hf is not None:  # the model's own chat template and tokenizer, as vLLM and SGLang render them
            prompt = self.render_hf(body)
            ids = hf.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", False)))
            await self.generate(resp, body, "chat", prompt, ids=ids)
            return
        prompt = render_chat(messages, body.get("tools"))
        await self.generate(resp, body, "chat", prompt)

    def render_hf(self, body: dict[str, Any]) -> str:
        """A chat request's prompt through the model's chat template; a request it refuses is a 400, as in vLLM."""
        assert self.server.hf is not None
        try:
            return self.server.hf.render_request(body)
        except Exception as exc:  # jinja2.TemplateError (raise_exception), or a template broken by the input
            raise EngineError(400, f"Chat template error: {exc}") from exc

    async def completions(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        self.check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = "".join(str(p) for p in prompt)
        if not isinstance(prompt, str):
            raise EngineError(400, "'prompt' must be a string", param="prompt")
        hf = self.server.hf
        ids = hf.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True))) if hf else None
        await self.generate(resp, body, "completion", prompt, ids=ids)

    async def generate(self, resp: Responder, body: dict[str, Any], kind: str, prompt: str,
                       max_tokens: int | None = None, constraint: Constraint | None = None,
                       stream: bool | None = None, ids: list[int] | None = None) -> None:
        """``ids``: the prompt's token ids when the caller has them (the model's tokenizer), else the emulator's
        tokenizer encodes ``prompt``."""
        server = self.server
        if ids is None:
            ids = server.tokenizer.encode(prompt)
        if max_tokens is None:
            max_tokens = self.max_tokens(body)
        try:
            max_tokens = self.context_room(len(ids), max_tokens)
        except ContextTooLong as exc:
            raise self.context_error(exc, len(ids), max_tokens) from exc
        salt = self.cache_salt(body)
        tool, reasoning = self.agent(body, ids) if kind == "chat" else (None, False)
        if tool is not None:
            constraint = Constraint("json", tool.schema)
        if constraint is None:
            constraint = self.constraint(body, kind)
        try:
            plan = self.plan(ids, max_tokens, constraint, bool(body.get("ignore_eos")), reasoning=reasoning)
        except ValueError as exc:  # ConstraintError is a ValueError
            raise self.constraint_error(exc) from exc
        try:
            server.scheduler.check(len(ids), len(plan.ids) if max_tokens is None else max_tokens)
        except ContextTooLong as exc:
            raise self.context_error(exc, len(ids), max_tokens) from exc
        rank = self.queue_rank(body)
        opts = body.get("stream_options") or {}
        gen = Gen(id=new_id("chatcmpl-" if kind == "chat" else "cmpl-"), model=self.model, kind=kind,
                  stream=bool(body.get("stream")) if stream is None else stream,
                  include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
                  plan=plan, prompt_len=len(ids), scale=self.spec.time_scale, body=body, rank=rank, salt=salt)
        if tool is not None:
            gen.tool, gen.tool_id = tool, self.new_tool_id()
            gen.tool_finish = self.tool_finish(tool)
        await drive(self, gen, ids, resp)

    def agent(self, body: dict[str, Any], ids: list[int]) -> tuple[ToolPick | None, bool]:
        """The chat request's tool call (if any) and whether the model reasons first."""
        rng = request_rng(self.spec.seed, ids, -1 - self.server.stats.requests)  # its own stream: text unchanged
        try:
            tool = pick_tool(body, self.spec.tool_call_rate, rng)
        except ValueError as exc:
            raise EngineError(400, str(exc), param="tool_choice") from exc
        return tool, self.spec.reasoning and thinking_enabled(body)

    def tool_finish(self, tool: ToolPick) -> str:
        return "tool_calls"

    def new_tool_id(self) -> str:
        return new_id(self.tool_id_prefix)

    def plan(self, ids: list[int], max_tokens: int | None, constraint: Constraint | None = None,
             ignore_eos: bool = False, reasoning: bool = False) -> Plan:
        """What the model says to prompt ``ids``: reasoning words first when ``reasoning``, then the answer; both
        count against ``max_tokens``. Raises ValueError for a constraint it cannot satisfy."""
        server = self.server
        p = server.profile
        rng = request_rng(self.spec.seed, ids, server.stats.requests)
        think = Plan([], [], "stop")
        if reasoning:
            words = reasoning_words(rng)
            think = Plan(words, [server.tokenizer.piece_id(w) for w in words], "stop")
            if server.hf is not None:
                think = model_tokens(server.hf, think, None, extend=False)
            if max_tokens is not None and max_tokens <= len(think.ids):
                return Plan(think.pieces[:max_tokens], think.ids[:max_tokens], "length", reasoning=max_tokens)
            max_tokens = None if max_tokens is None else max_tokens - len(think.ids)
        plan = plan_output(server.tokenizer, rng, max_tokens, (p.natural_min_tokens, p.natural_max_tokens),
                           constraint, ignore_eos)
        if server.hf is not None:
            plan = model_tokens(server.hf, plan, max_tokens, extend=constraint is None)
        if not think.ids:
            return plan
        return Plan(think.pieces + plan.pieces, think.ids + plan.ids, plan.finish_reason, reasoning=len(think.ids))

    def constraint_error(self, exc: ValueError) -> EngineError:
        return EngineError(400, f"Invalid structured output constraint: {exc}")

    async def embeddings(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        self.check_model(body)
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not inputs:
            raise EngineError(400, "'input' must be a string or a non-empty list", param="input")
        data, total = [], 0
        for i, text in enumerate(inputs):
            text = content_text(text) if not isinstance(text, list) else " ".join(map(str, text))
            total += len(self.server.tokenizer.encode(text))
            data.append({"object": "embedding", "index": i, "embedding": embed(text)})
        self.send_json(resp, {"object": "list", "data": data, "model": self.model,
                              "usage": {"prompt_tokens": total, "total_tokens": total}})

    async def rerank(self, req: Request, resp: Responder) -> None:
        assert self.rerank_shape is not None
        body = self.parse_json(req)
        self.check_model(body)
        query, documents, top_n = parse(body)
        tokenizer = self.server.tokenizer
        ranked = rank(query, documents, lambda text: len(tokenizer.encode(text)))
        self.send_json(resp, answer(self.rerank_shape, self.model, body, ranked, top_n))

    # -- default shapes (vLLM's) -----------------------------------------------------------------------------
    def usage(self, gen: Gen) -> dict[str, Any]:
        u: dict[str, Any] = {"prompt_tokens": gen.prompt_len, "total_tokens": gen.prompt_len + gen.completion_tokens,
                             "completion_tokens": gen.completion_tokens}
        if self.spec.cache_report:
            u["prompt_tokens_details"] = {"cached_tokens": gen.cached}
        if self.spec.reasoning:  # vLLM reports it whenever a reasoning parser is configured
            u["completion_tokens_details"] = {"reasoning_tokens": gen.reasoning_tokens}
        return u

    # -- agent shapes: reasoning and tool call deltas, the non-streamed tool call -----------------------------
    def delta_chunk(self, gen: Gen, delta: dict[str, Any]) -> dict[str, Any]:
        """A streamed chat chunk carrying ``delta`` (no finish reason)."""
        return {**self.chunk_base(gen), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                     "finish_reason": None}]}

    def reasoning_chunk(self, gen: Gen) -> dict[str, Any]:
        return self.delta_chunk(gen, {self.reasoning_key: _MARK})

    def tool_start_delta(self, gen: Gen) -> dict[str, Any]:
        assert gen.tool is not None
        return {"tool_calls": [{"id": gen.tool_id, "type": "function", "index": 0,
                                "function": {"name": gen.tool.name, "arguments": ""}}]}

    def tool_args_delta(self, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}

    def answer_start_events(self, gen: Gen) -> list[Event]:
        return [self.delta_chunk(gen, self.tool_start_delta(gen))] if gen.tool is not None else []

    def tool_calls(self, gen: Gen) -> list[dict[str, Any]]:
        """The non-streamed message's ``tool_calls``."""
        assert gen.tool is not None
        return [{"id": gen.tool_id, "type": "function", "function": {"name": gen.tool.name, "arguments": gen.text}}]

    def chat_message(self, gen: Gen) -> dict[str, Any]:
        """vLLM's: forced tool calls have content ``""``, ``tool_calls`` is left out when empty."""
        msg: dict[str, Any] = {"role": "assistant", "content": gen.text, "reasoning": gen.reasoning_text or None}
        if gen.tool is not None:
            msg["content"] = "" if gen.tool.forced else None
            msg["tool_calls"] = self.tool_calls(gen)
        return msg

    def chunk_base(self, gen: Gen) -> dict[str, Any]:
        obj = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
        return {"id": gen.id, "object": obj, "created": gen.created, "model": gen.model}

    def token_choice(self, gen: Gen, text: str, finish: str | None) -> dict[str, Any]:
        if gen.kind == "chat":
            delta = {"content": text}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                    **({"stop_reason": None} if finish else {})}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}

    def token_chunk(self, gen: Gen) -> dict[str, Any] | None:
        if gen.tool is not None:
            return self.delta_chunk(gen, self.tool_args_delta(_MARK))
        return {**self.chunk_base(gen), "choices": [self.token_choice(gen, _MARK, None)]}

    def head_events(self, gen: Gen) -> list[Event]:
        if gen.kind != "chat":
            return []
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self.chunk_base(gen), "choices": [choice]}]

    def tail_events(self, gen: Gen) -> list[Event]:
        out: list[Event] = [{**self.chunk_base(gen), "choices": [self.token_choice(gen, "", gen.finish_reason)]}]
        if gen.include_usage:
            out.append({**self.chunk_base(gen), "choices": [], "usage": self.usage(gen)})
        out.append(b"[DONE]")
        return out

    def full_response(self, gen: Gen) -> dict[str, Any]:
        if gen.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": self.chat_message(gen),
                                      "logprobs": None, "finish_reason": gen.finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason,
                      "stop_reason": None}
            obj = "text_completion"
        return {"id": gen.id, "object": obj, "created": gen.created, "model": gen.model, "choices": [choice],
                "usage": self.usage(gen)}


def embed(text: str) -> list[float]:
    """A deterministic unit vector derived from the text's hash (no meaning, stable across processes)."""
    raw = b""
    counter = 0
    while len(raw) < EMBED_DIM * 4:
        raw += hashlib.sha256(f"{counter}:{text}".encode()).digest()
        counter += 1
    vals = [v / 2**31 - 1.0 for v in struct.unpack(f"<{EMBED_DIM}I", raw[: EMBED_DIM * 4])]
    norm = math.sqrt(sum(v * v for v in vals)) or 1.0
    return [v / norm for v in vals]


def model_tokens(hf: HFTokenizer, plan: Plan, max_tokens: int | None, extend: bool = True) -> Plan:
    """The planned text as the model's tokens: one piece per token of ``hf`` (so completion counts, timing and
    the ids cached after the sequence are the model's). A length-limited plan is cut to ``max_tokens`` tokens,
    and free text (``extend``) also lengthened with its own words to exactly that; a plan that ends with EOS
    keeps its text."""
    text = plan.text
    pieces, ids = hf.pieces(text)
    finish = plan.finish_reason
    if extend and finish == "length" and max_tokens is not None and 0 < len(ids) < max_tokens:
        words = [p.strip() for p in plan.pieces if p.strip()] or ["the"]
        i = 0
        while len(ids) < max_tokens:
            text += "".join(" " + words[(i + k) % len(words)] for k in range(max_tokens - len(ids)))
            i += max_tokens
            pieces, ids = hf.pieces(text)
    if max_tokens is not None and len(ids) > max_tokens:
        pieces, ids, finish = pieces[:max_tokens], ids[:max_tokens], "length"
    if not ids:  # an empty answer is still one sampled token: EOS
        pieces, ids = [""], [hf.eos_id if hf.eos_id is not None else 0]
    return Plan(pieces, ids, finish)
