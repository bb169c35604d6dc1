"""The engines' own request models and the code that turns a request into sampling parameters, per release.

Each :class:`RequestSide` answers the two questions the conformance tests ask of an engine: does this body
validate in the engine's request model for the route, and what constraint do the engine's sampling parameters
then carry. Everything that answers is the engine's released code, loaded by :mod:`tests.released.loader`;
the stubs below are only what that code imports and does not run on this path.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel

from tests.released.loader import EngineCode
from tests.released.sources import Release


@dataclass(frozen=True)
class Parsed:
    """A body as the engine read it: its request object, and the structured-output constraint its sampling
    parameters carry (engine field -> value, e.g. ``{"json_schema": '{"type": ...}'}``; empty when none)."""

    request: Any
    constraint: dict[str, Any]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # vLLM's StructuredOutputsParams options


class RequestSide:
    """One release's request models (``chat``, ``completions``)."""

    release: Release
    code: EngineCode

    def parse(self, route: str, body: dict[str, Any]) -> Parsed:
        """``body`` as the engine reads it (a copy: the engines' validators rewrite the dict they are given)."""
        raise NotImplementedError


# --- SGLang ------------------------------------------------------------------------------------------------
_SGLANG_CONSTRAINT_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


class _StructuralTag(BaseModel):
    """A stand-in for ``xgrammar.StructuralTag`` (xgrammar is not installed here, and SGLang's protocol then
    types the new structural-tag form ``Any``, leaving it a dict its code cannot read): its two fields as xgrammar
    declares them (``type: Literal["structural_tag"]``, ``format``), the format tree itself unchecked."""

    type: Literal["structural_tag"] = "structural_tag"
    format: dict[str, Any]


def _xgrammar() -> ModuleType:
    module = ModuleType("xgrammar")
    module.StructuralTag = _StructuralTag  # type: ignore[attr-defined]
    return module


class SGLangRequests(RequestSide):
    """``srt/entrypoints/openai/protocol.py`` whole; chat's sampling parameters from
    ``ChatCompletionRequest.to_sampling_params``, completions' from ``OpenAIServingCompletion.
    _build_sampling_params`` (``serving_completions.py``, a method that reads only the request: taken alone,
    without the serving module's torch-heavy imports); ``sglang.utils.convert_json_schema_to_str`` alone."""

    def __init__(self, release: Release, root: Path) -> None:
        self.release = release
        self.code = EngineCode(
            root, "sglang",
            real={"sglang.srt.entrypoints.openai.protocol"},
            partial={"sglang.utils": ["convert_json_schema_to_str"],
                     "sglang.srt.entrypoints.openai.serving_completions": [
                         "OpenAIServingCompletion._build_sampling_params"]},
            external={"xgrammar": _xgrammar()},
        )
        with self.code.active():
            self._protocol = self.code.module("sglang.srt.entrypoints.openai.protocol")
            self._completions = self.code.module("sglang.srt.entrypoints.openai.serving_completions")

    def parse(self, route: str, body: dict[str, Any]) -> Parsed:
        body = copy.deepcopy(body)
        with self.code.active():
            if route == "chat":
                request = self._protocol.ChatCompletionRequest.model_validate(body)
                params = request.to_sampling_params(stop=[], model_generation_config={})
            else:
                request = self._protocol.CompletionRequest.model_validate(body)
                params = self._completions._build_sampling_params(None, request)
        return Parsed(request, {k: params[k] for k in _SGLANG_CONSTRAINT_KEYS if params.get(k) is not None})


# --- vLLM --------------------------------------------------------------------------------------------------
_VLLM_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_VLLM_OPTION_KEYS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")


class _VLLMLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """vllm.logger.init_logger's logger: the standard one with its ``*_once`` methods."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})

    def debug_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.debug(msg, *args)

    def info_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.info(msg, *args)

    def warning_once(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.warning(msg, *args)


class VLLMRequests(RequestSide):
    """The chat and completion request models and their ``to_sampling_params`` (``entrypoints/openai/
    {chat_completion,completion}/protocol.py``), the shared request protocol they import (0.34: ``entrypoints/
    generate/base`` and ``serve/engine``; 0.23: ``entrypoints/openai/engine``), ``sampling_params.py``
    (``SamplingParams``, ``StructuredOutputsParams``), ``envs.py`` and ``exceptions.py``; of
    ``v1/serial_utils.py`` only ``PydanticMsgspecMixin`` (the rest imports torch). ``v1/structured_output/
    backend_xgrammar.py`` stays a stub: the structural-tag check it does (xgrammar compiling the tag) is not run
    here, only the request models' own validation and the path the tag takes into the sampling parameters."""

    def __init__(self, release: Release, root: Path) -> None:
        self.release = release
        shared = [name for name in ("vllm.entrypoints.generate.base.protocol", "vllm.entrypoints.serve.engine.protocol",
                                    "vllm.entrypoints.openai.engine.protocol")
                  if (root / Path(*name.split("."))).with_suffix(".py").exists()]
        self.code = EngineCode(
            root, "vllm",
            real={"vllm.envs", "vllm.exceptions", "vllm.sampling_params", *shared,
                  "vllm.entrypoints.openai.chat_completion.protocol", "vllm.entrypoints.openai.completion.protocol"},
            stubs={"vllm.logger": {"init_logger": _VLLMLogger}},
            partial={"vllm.v1.serial_utils": ["PydanticMsgspecMixin"]},
            external={"regex": re},  # 0.23 imports the regex package for one re.match
        )
        with self.code.active():
            self._chat = self.code.module("vllm.entrypoints.openai.chat_completion.protocol")
            self._completion = self.code.module("vllm.entrypoints.openai.completion.protocol")

    def parse(self, route: str, body: dict[str, Any]) -> Parsed:
        body = copy.deepcopy(body)
        with self.code.active():
            model = self._chat.ChatCompletionRequest if route == "chat" else self._completion.CompletionRequest
            request = model.model_validate(body)
            params = request.to_sampling_params(max_tokens=16, default_sampling_params={})
        so = params.structured_outputs
        found = {} if so is None else {k: getattr(so, k) for k in _VLLM_CONSTRAINT_KEYS if getattr(so, k) is not None}
        options = {} if so is None else {k: getattr(so, k) for k in _VLLM_OPTION_KEYS}
        return Parsed(request, found, options)
