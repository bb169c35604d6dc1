"""llama.cpp's sampler chain, and which requests would have it sort the whole vocabulary at every token.

llama-server samples each slot's next token on the main loop that every slot shares. A chain with a sampler
that may sort (top_p, typical_p, min_p, XTC, infill) before its top_k sorts the whole vocabulary at every token;
so does a top_k of 0 (off) or one larger than :data:`MAX_TOP_K`, and mirostat (which ignores the chain). With a
128k vocabulary that is 13-20 ms a token against 3 for the default chain, and other keys' streams ran at an
eighth of their pace beside one such request (sweep 21); top_k 1,000 with typical_p cost what the default chain
costs. Samplers of one linear pass may come before top_k, as in llama.cpp's default chain (penalties, DRY,
top-n-sigma, temperature without ``dynatemp_range``, which sorts every candidate); adaptive_p picks the token
at the end of the chain wherever it is named. A name this version of llama.cpp does not know (and skips) may
be a sampler of another: it counts as one that sorts.

The names and letters are llama.cpp's (common/sampling.cpp, common_sampler_types_from_names / _from_chars).
"""

from __future__ import annotations

from typing import Any

NAMES = {"dry": "d", "top_k": "k", "top_p": "p", "top_n_sigma": "s", "typ_p": "y", "min_p": "m",
              "temperature": "t", "xtc": "x", "infill": "i", "penalties": "e", "adaptive_p": "a"}
# every name llama.cpp takes (in any case): a canonical one, with '-' for '_' or without it, and three aliases
SAMPLERS = {**NAMES, **{n.replace("_", "-"): c for n, c in NAMES.items()},
            **{n.replace("_", ""): c for n, c in NAMES.items()}, "nucleus": "p", "temp": "t", "typ": "y"}
MAX_TOP_K = 1000
_LINEAR = frozenset("desta")  # samplers of one pass over the candidates, that may come before top_k


def sampler_chain(samplers: str | list[Any]) -> list[str] | None:
    """``samplers`` (a string of letters, or an array of names) as the letters of llama.cpp's chain; a name it
    does not know kept as written, in lower case (llama.cpp skips it). None: an array with a non-string entry."""
    if isinstance(samplers, str):
        return list(samplers)
    if not all(isinstance(name, str) for name in samplers):
        return None
    return [SAMPLERS.get(name.lower(), name.lower()) for name in samplers]


def whole_vocabulary(body: dict[str, Any]) -> str | None:
    """The field by which llama.cpp would sort the whole vocabulary at every token (``mirostat``, ``top_k``,
    ``samplers``), or None. (An engine that samples this way refuses such a request: EngineSpec.whole_vocabulary.)"""
    mirostat = body.get("mirostat")
    if mirostat is not None and mirostat is not False and mirostat != 0:
        return "mirostat"
    top_k = body.get("top_k")
    if top_k is not None and (type(top_k) is not int or not 1 <= top_k <= MAX_TOP_K):
        return "top_k"
    samplers = body.get("samplers")
    # (temperature with a dynamic range sorts every candidate to weigh their entropy: llama_sampler_temp_ext_apply,
    # softmax_impl(cur_p, true); before top_k, 17 ms a token against 3 with a 128k vocabulary, sweep 24)
    dynamic = body.get("dynatemp_range")  # (a boolean too: llama.cpp's JSON reads true as 1.0, sweep 25)
    dynamic = isinstance(dynamic, int | float) and dynamic > 0
    for letter in (sampler_chain(samplers) or ()) if isinstance(samplers, str | list) else ():
        if letter == "k":
            break
        if letter == "t" and dynamic:
            return "dynatemp_range"
        if letter not in _LINEAR:
            return "samplers"
    return None
