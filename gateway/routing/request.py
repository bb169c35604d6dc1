"""What routing knows about a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RouteRequest:
    route: str  # "chat" | "completions" | "embeddings"
    model: str
    stream: bool
    max_tokens: int | None
    body: dict[str, Any]  # the parsed request, for plugins that need the prompt
