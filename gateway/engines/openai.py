"""Any other OpenAI-compatible server (TGI, LM Studio, a hosted API): no load signals, models from /v1/models.

``/v1/models`` doubles as the health probe, since ``/health`` is not part of the OpenAI API.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.engines.base import EngineAdapter


class OpenAIAdapter(EngineAdapter):
    engine: ClassVar[str] = "openai"
    health_path: ClassVar[str] = "/v1/models"
    # the OpenAI API's own fields only: response_format and (strict) tools
