"""Any other OpenAI-compatible server (TGI, LM Studio, a hosted API): no load signals, models from /v1/models.

``/v1/models`` doubles as the health probe, since ``/health`` is not part of the OpenAI API. Its stream may
have any quirk the relay knows, so every quirk flag is on.
"""

from __future__ import annotations

from typing import ClassVar

from gateway.engines.base import EngineAdapter
from gateway.engines.spec import ALL_CACHE_FIGURES, ALL_QUIRKS, LLAMACPP_CACHE_REPORTS, EngineSpec

# the OpenAI API's own fields only: response_format and (strict) tools
# (an unknown make may report its cache in any of the known ways)
# (any OpenAI-compatible server: llama-server, TabbyAPI and the rest may be behind one, so what any of them says of
# its cache is taken out, and what makes llama-server say more is not sent)
SPEC = EngineSpec(name="openai", health_path="/v1/models", stream=ALL_QUIRKS, cache_figures=ALL_CACHE_FIGURES,
                  cache_report_params=LLAMACPP_CACHE_REPORTS, several_generations=False,
                  whole_vocabulary=False, many_parses=False)


class OpenAIAdapter(EngineAdapter):
    spec: ClassVar[EngineSpec] = SPEC
