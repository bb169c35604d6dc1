"""Agent features of an emulated chat request: the tool call the model makes, if any, and whether it reasons first.

``tool_choice`` ``"required"`` calls the first tool, ``{"type": "function", "function": {"name": ...}}`` calls that
one; ``"auto"`` (or no ``tool_choice`` with ``tools``) calls the first tool at the server's ``tool_call_rate``
unless the conversation's last message is a tool's result, which the model answers (so an agent's tool round
trip ends, as it does with a real model); ``"none"`` never calls. One call per answer (so
``parallel_tool_calls: false`` is honoured). The arguments are a valid instance of the tool's ``parameters``
schema (:mod:`gateway.sim.constrained`).

A reasoning model (``SimSpec.reasoning``) answers with some reasoning words first, unless the request turns
thinking off (``chat_template_kwargs.enable_thinking: false``, or TabbyAPI's top-level ``enable_thinking`` /
``reasoning.enabled``, which every emulator accepts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

REASONING_WORDS = ("first", "let", "me", "think", "the", "user", "wants", "so", "check", "then", "answer", "plan",
                   "maybe", "step", "next", "ok")
REASONING_TOKENS = (12, 40)  # words of reasoning, uniform in this range


@dataclass(frozen=True)
class ToolPick:
    """The one tool call an answer makes: the function, its parameters schema, and how it was chosen."""

    name: str
    schema: dict[str, Any]
    forced: bool  # "required" or a named tool
    named: bool


def _function(tool: Any) -> dict[str, Any] | None:
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("name"), str):
        return fn
    return None


def pick_tool(body: dict[str, Any], rate: float, rng: random.Random) -> ToolPick | None:
    """The tool call the request gets, or None. Raises ValueError for a named tool that is not in ``tools``."""
    tools = [fn for fn in map(_function, body.get("tools") or []) if fn is not None]
    if not tools:
        return None
    choice = body.get("tool_choice", "auto")
    if choice is None:
        choice = "auto"
    named = isinstance(choice, dict)
    if named:
        want = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        fn = next((t for t in tools if t["name"] == want), None)
        if fn is None:
            raise ValueError(f"Tool '{want}' has not been passed in `tools`.")
    elif choice == "required":
        fn = tools[0]
    elif choice == "auto":
        if rate <= 0 or rng.random() >= rate or _answers_a_tool(body):
            return None
        fn = tools[0]
    else:  # "none" (or anything else): no call
        return None
    schema = fn.get("parameters")
    return ToolPick(fn["name"], schema if isinstance(schema, dict) else {"type": "object"}, forced=choice != "auto",
                    named=named)


def _answers_a_tool(body: dict[str, Any]) -> bool:
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    return isinstance(last, dict) and last.get("role") == "tool"


def thinking_enabled(body: dict[str, Any]) -> bool:
    """False when the request turns a reasoning model's thinking off."""
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False:
        return False
    if body.get("enable_thinking") is False:
        return False
    reasoning = body.get("reasoning")
    return not (isinstance(reasoning, dict) and reasoning.get("enabled") is False)


def reasoning_words(rng: random.Random) -> list[str]:
    """The reasoning text, as word pieces (each one token of the emulators' own tokenizer)."""
    n = rng.randint(*REASONING_TOKENS)
    words = [REASONING_WORDS[rng.randrange(len(REASONING_WORDS))] for _ in range(n)]
    return [w if i == 0 else " " + w for i, w in enumerate(words)]
