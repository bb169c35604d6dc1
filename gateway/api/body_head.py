"""What the key's checks need of a request body, read without decoding the rest of it.

The key's checks (its model allow-list, its budgets) come before anything costly is done for a request, and
decoding the whole body is costly for some bodies: 8 MiB of ``[[],[],...]`` is 2.8 million Python lists, 0.3 to
1.5 s of one core for orjson on our machines, all of it on the event loop. msgspec reads the few top-level
fields the checks need (the model, the output-token fields, the choices, the prompts, the stored conversation it
continues) into a struct and *skips* everything else without building a Python object of it: 10 to 40 ms for
the same 8 MiB, 2 to 6 ms for an ordinary 1 MiB body. Each field is kept as its raw JSON text
(``msgspec.Raw``) and decoded only when it is short, so no field can be made expensive either.

A body of at most :data:`SMALL_BODY` bytes (most requests) is decoded whole first instead, and its head read
from that (:func:`head_of`): one decode, not two. A larger one is decoded whole after the key's checks, and then
checked against this head
(:func:`check_same`): both decoders keep the last of duplicate keys, and a body whose full decoding disagrees
with its head anyway is refused, so the checks can never have seen a different request than the one sent.

:func:`check_containers` bounds the full decode itself: a body may hold at most ``limits.max_json_containers``
objects and arrays (what decoding and translating cost per item), counted in C before it is decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from gateway.config import LimitSettings
from gateway.errors import GatewayError
from gateway.proxy.forward import parse_units

_NULL = msgspec.Raw(b"null")
_SHORT = 256  # a field longer than this (raw JSON) is not what the checks look for: read as absent / invalid
# A body this small is decoded whole before the key's checks (once, as every request is): it holds so few values
# that decoding it costs no more than reading its head would (at worst ~8,000 empty arrays, a few milliseconds).
SMALL_BODY = 16 * 1024
_MODEL_MAX = 1024


class _Fields(msgspec.Struct):
    model: msgspec.Raw = _NULL
    n_predict: msgspec.Raw = _NULL
    max_length: msgspec.Raw = _NULL
    min_tokens: msgspec.Raw = _NULL
    min_length: msgspec.Raw = _NULL
    max_tokens: msgspec.Raw = _NULL
    max_completion_tokens: msgspec.Raw = _NULL
    max_output_tokens: msgspec.Raw = _NULL
    n: msgspec.Raw = _NULL
    best_of: msgspec.Raw = _NULL
    n_cmpl: msgspec.Raw = _NULL
    prompt: msgspec.Raw = _NULL
    previous_response_id: msgspec.Raw = _NULL


_DECODER = msgspec.json.Decoder(_Fields)
# what a request may generate, however it is spelled: chat, completions; Responses; llama.cpp (which reads it
# before max_tokens): the most any of them says
_OUTPUT_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens", "n_predict", "max_length", "min_tokens",
                  "min_length")
# how many choices a request asks for, however it is spelled (llama.cpp's own: n_cmpl)
CHOICE_FIELDS = ("n", "best_of", "n_cmpl")


def _bad(message: str, param: str | None) -> GatewayError:
    return GatewayError(400, message, param=param, code="invalid_request")


def _short(raw: msgspec.Raw, limit: int = _SHORT) -> Any:
    """A field's value when it is short JSON that orjson reads as the full decode will (not ``1e999``: msgspec
    reads it, orjson refuses it, and the request is refused when decoded whole), else None."""
    text = bytes(raw)
    if len(text) > limit:
        return None
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return None


def _positive(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass(frozen=True, slots=True)
class BodyHead:
    """The top-level fields of a request body the key's checks read. ``output``: the largest positive integer
    of ``max_completion_tokens``, ``max_tokens``, ``max_output_tokens``, ``n_predict`` (0: none); ``choices``: the
    largest of ``n``, ``best_of`` and llama.cpp's ``n_cmpl`` (1 when none); ``prompts``: how many prompts a
    completions ``prompt`` holds; ``previous``: the Responses conversation it continues. A value the validation
    will refuse later reads as absent here."""

    model: str
    output: int
    choices: int
    prompts: int
    previous: str | None

    @classmethod
    def read(cls, raw: bytes) -> BodyHead:
        """The head of ``raw``; a 400 when it is not a JSON object or names no model."""
        try:
            fields = _DECODER.decode(raw)
        except msgspec.ValidationError:
            raise _bad("The request body must be a JSON object", None) from None
        except msgspec.DecodeError as exc:
            raise _bad(f"We could not parse the JSON body of your request: {exc}", None) from None
        except RecursionError:  # (msgspec skips what it does not read recursively: ~1,000 levels deep is too deep)
            raise _bad("The request body nests too deep to be read (the gateway accepts 254 levels)", None) from None
        model = _short(fields.model, _MODEL_MAX)
        if not isinstance(model, str) or not model:
            raise _bad("'model' is required and must be a non-empty string", "model")
        output = max(_positive(_short(getattr(fields, f))) for f in _OUTPUT_FIELDS)
        choices = max(1, *(_positive(_short(getattr(fields, f))) for f in CHOICE_FIELDS))
        previous = _short(fields.previous_response_id)
        return cls(model, output, choices, _prompts(fields.prompt), previous if isinstance(previous, str) else None)


def _prompts(raw: msgspec.Raw) -> int:
    """Prompts in a completions ``prompt``: one string or one list of token ids is one; a list of strings or of
    token-id lists is one each (each is generated for: ``n`` times ``max_tokens`` apiece). Counted in C: the
    quotes of a list of strings (two a string, less the escaped ones), the inner lists of a list of token-id
    lists (which hold only numbers)."""
    text = bytes(raw).strip()
    if not text.startswith(b"["):
        return 1
    first = text[1:].lstrip()[:1]
    if first == b'"':
        return max(1, (text.count(b'"') - text.count(b'\\"')) // 2)
    if first == b"[":
        return text.count(b"[") - 1
    return 1


def _short_value(value: Any) -> Any:
    """``value`` as :func:`_short` would have read it from the raw text."""
    if value is None or isinstance(value, bool | int | float):  # (the common cases, without encoding them)
        return value if not isinstance(value, int) or abs(value) < 10**200 else None
    return value if len(orjson.dumps(value)) <= _SHORT else None


def prompt_count(prompt: Any) -> int:
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(isinstance(p, list) for p in prompt)):
        return len(prompt)
    return 1


def head_of(body: dict[str, Any]) -> BodyHead:
    """The head of a body decoded whole already (a small one: see :data:`SMALL_BODY`), read as
    :meth:`BodyHead.read` reads it from the raw text; a 400 when it names no model."""
    model = body.get("model")
    if not isinstance(model, str) or not model or len(model) > _MODEL_MAX:
        raise _bad("'model' is required and must be a non-empty string", "model")
    previous = _short_value(body.get("previous_response_id"))
    return BodyHead(model, max(_positive(_short_value(body.get(f))) for f in _OUTPUT_FIELDS),
                    max(1, *(_positive(_short_value(body.get(f))) for f in CHOICE_FIELDS)),
                    prompt_count(body.get("prompt")), previous if isinstance(previous, str) else None)


def check_same(head: BodyHead, body: dict[str, Any]) -> None:
    """A 400 when the decoded body names another model or stored conversation than its head did, or asks for
    more (output tokens, choices, prompts) than its head read, which the key's checks admitted: both decoders
    keep the last of duplicate keys, so this only guards against the two ever disagreeing."""
    try:
        seen = head_of(body)
    except GatewayError:
        seen = None
    if (seen is None or seen.model != head.model or seen.previous != head.previous or seen.prompts > head.prompts
            or seen.choices > head.choices or seen.output > head.output):
        raise _bad("The request body holds duplicate keys that its decoders read differently", None)


def check_containers(raw: bytes, limits: LimitSettings) -> None:
    """A 400 for a body of more than ``limits.max_json_containers`` ``[`` and ``{`` characters, strings included,
    or costing more than ``limits.max_json_values`` to decode (its characters counted, as
    :func:`gateway.proxy.forward.parse_units` does for answers, and an object's keys too):
    counted in C (a few milliseconds for 8 MiB), where telling the ones in strings apart would cost more than what
    it protects (a regex over 8 MiB of short strings: 0.4 s). Each object or array takes one; so few prompts hold
    more in their text that they would fit any model's context."""
    limit = limits.max_json_containers
    if len(raw) <= limit:  # (fewer bytes than the limit: fewer brackets too)
        return
    count = raw.count(b"[") + raw.count(b"{")
    if count > limit:
        raise _bad(f"The request body holds {count} '[' and '{{' characters (JSON objects and arrays, and any in "
                   f"its strings); this gateway accepts at most limits.max_json_containers = {limit}", None)
    # what decoding costs beyond its containers, as an answer's is counted (sweep 13: one object of 700,000 distinct
    # keys, one container, held the event loop 0.23-0.31 s, and other keys' Redis admissions timed out; sweep 14:
    # counting '":' for keys missed `"k" :1`)
    units = parse_units(raw)
    if units > limits.max_json_values:
        raise _bad(f"The request body holds about {units} JSON values weighted by what decoding each costs; this "
                   f"gateway accepts at most limits.max_json_values = {limits.max_json_values}", None)
