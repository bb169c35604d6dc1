"""``gateway llamacpp calibrate``: the llama.cpp emulator against a real ``llama-server`` on this CPU.
``measure`` drives a server, ``fit`` turns measurements into figures and emulator parameters, ``report``
compares and draws, ``cli`` runs it all (see its docstring)."""

from gateway.llamacpp.calibrate.cli import main, no_nan
from gateway.llamacpp.calibrate.common import (
    CACHED_PREFIXES,
    CTX_PER_SLOT,
    DECODE_TOKENS,
    FLOOR_LENGTH,
    LENGTHS,
    SWEEP_TOKENS,
    Run,
    Summary,
    Workload,
)
from gateway.llamacpp.calibrate.fit import (
    compare,
    derive_overrides,
    fit_prefill,
    least_squares,
    refine,
    shape_ratios,
    summarize,
)
from gateway.llamacpp.calibrate.report import table

__all__ = [
    "CACHED_PREFIXES", "CTX_PER_SLOT", "DECODE_TOKENS", "FLOOR_LENGTH", "LENGTHS", "SWEEP_TOKENS", "Run", "Summary",
    "Workload", "compare", "derive_overrides", "fit_prefill", "least_squares", "main", "no_nan", "refine",
    "shape_ratios", "summarize", "table",
]
