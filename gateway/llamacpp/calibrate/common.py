"""What the calibration measures and compares: its fixed settings and its records."""

from __future__ import annotations

from dataclasses import dataclass, field

LENGTHS = (100, 250, 500, 1000, 2000)  # uncached prompt lengths; ratios are against the first
FLOOR_LENGTH = 16  # a tiny prompt: the fixed per-request cost (fit only)
CACHED_PREFIXES = (1000, 1800)  # cached prefix tokens of a prompt of max(LENGTHS) tokens
SWEEP_TOKENS = 32  # tokens generated per sweep request (also gives decode speed at that context)
DECODE_TOKENS = 64  # tokens generated in the decode measurements
QUEUE_PROMPT = 250
QUEUE_TOKENS = 32
QUEUE_REQUESTS = 4
QUEUE_STAGGER_S = 0.005  # requests leave 5 ms apart, so arrival order (and slot order) is defined
PROBE_ROUNDS = 3
SLOTS = 2
CTX_PER_SLOT = 4096
PREFILL_BATCH = 2048  # llama-server's default n_batch: prompt tokens per llama_decode call
TOLERANCE = 0.15
MODEL_NAME = "calibration"
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word"
    " but not what all were we when your can said there use an each which she do how their if will up other"
    " about out many then them these so some her would make like him into time has look two more write go see"
    " number no way could people my than first water been call who oil its now find long down day did get come"
    " made may part model token cache prefix server gateway request stream json value name list item key string"
).split()
ADJUSTMENTS = [
    "prefill_base_s (new): a fixed cost on every step that processes prompt tokens; the real server needs a few "
    "ms for a 16-token prompt, the emulator answered it at once",
    "prefill_ctx_growth (new): prefill cost per token grows with its position (attention); the real TTFT is "
    "quadratic in prompt length (2,000 tokens cost ~35x what 100 do, not 20x), and a cached prefix still slows "
    "the uncached tail that attends to it, so a 90% cached prompt saves ~80%, not 90%",
    "decode_ctx_growth (new): each decoding sequence adds step time in proportion to its context (its KV reads); "
    "the real inter-token time grows several-fold from 100 to 2,000 tokens of context",
    "the scheduler sums per-chunk prefill costs at each chunk's positions and passes the decoding sequences' "
    "context to the step time; all three new parameters default to 0 (unchanged behaviour) except in the "
    "llamacpp-cpu profile",
    "profiles: 'llamacpp-cpu' holds the figures measured here (generated large model, 2 slots, 1 thread); "
    "'llamacpp' keeps only the published single-user anchor (no GPU measurement to set its context terms)",
]


# -- measurements ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One streamed request as the client saw it (seconds) and as the server reported it."""

    ttft: float
    itl: float  # mean seconds per token after the first; nan with fewer than 2 tokens
    tokens: int
    prompt_tokens: int
    cached: int
    server_prompt_ms: float | None = None
    chunks: int = 0


@dataclass
class Workload:
    """One round of the workload on one server."""

    floor: Run
    sweep: dict[int, Run]
    cached: dict[int, Run]
    decode1: Run
    decode2: list[Run]
    queue: list[Run]


@dataclass
class Summary:
    """One figure per measurement over rounds (see :func:`summarize`); seconds, keyed by prompt length, cached
    prefix or context."""

    floor_ttft: float
    ttft: dict[int, float]
    itl: dict[int, float]  # single-stream inter-token time keyed by the mean context while decoding
    cached_ttft: dict[int, float]
    cached_tokens: dict[int, int]
    decode_itl_1: float
    decode_itl_2: float
    decode_ctx: int  # context of each decode-measurement stream, mid-generation
    queue_ttft: list[float]  # by rank, fastest first
    slots: int = SLOTS
    ctx_per_slot: int = CTX_PER_SLOT
    lengths_sent: dict[int, int] = field(default_factory=dict)
