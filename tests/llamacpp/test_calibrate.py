"""The calibration report's pure logic: fits, parameter derivation, ratios (no servers, no timing)."""

from __future__ import annotations

import math

import pytest

from gateway.llamacpp import calibrate as cal
from gateway.sim.profiles import PROFILES

pytestmark = pytest.mark.unit


def synthetic(a: float = 0.003, b: float = 1e-4, c: float = 8e-8, d0: float = 5e-4, d1: float = 3e-6,
              growth: float = 1.5, slots: int = 2) -> cal.Summary:
    """Measurements a server following the emulator's model exactly would give."""
    def ttft(n: int) -> float:
        return a + b * n + c * n * n

    def itl(ctx: int, batch: int = 1) -> float:
        return d0 * (1 + growth * (batch - 1)) + d1 * ctx * batch

    decode_ctx = cal.FLOOR_LENGTH + cal.DECODE_TOKENS // 2
    longest = max(cal.LENGTHS)
    return cal.Summary(
        floor_ttft=ttft(cal.FLOOR_LENGTH),
        ttft={n: ttft(n) for n in cal.LENGTHS},
        itl={n + 16: itl(n + 16) for n in cal.LENGTHS},
        cached_ttft={p: a + b * (longest - p) + c * (longest**2 - p**2) for p in cal.CACHED_PREFIXES},
        cached_tokens={p: p for p in cal.CACHED_PREFIXES},
        decode_itl_1=itl(decode_ctx),
        decode_itl_2=itl(decode_ctx, 2),
        decode_ctx=decode_ctx,
        queue_ttft=[0.04, 0.08, 0.2, 0.24],
        slots=slots,
    )


def test_least_squares_recovers_a_polynomial() -> None:
    xs = [1.0, 2.0, 3.0, 5.0, 8.0]
    coef = cal.least_squares([[1.0, x, x * x] for x in xs], [2 + 3 * x + 0.5 * x * x for x in xs])
    assert coef == pytest.approx([2, 3, 0.5])


def test_prefill_fit_clamps_a_negative_curvature_and_intercept() -> None:
    a, b, c = cal.fit_prefill({100: 0.01, 1000: 0.1, 2000: 0.2})  # exactly linear through the origin
    assert c >= 0 and a >= 0 and b == pytest.approx(1e-4, rel=1e-6)
    a, b, c = cal.fit_prefill({100: 0.02, 1000: 0.1, 2000: 0.15})  # concave: falls back to a line
    assert c == 0.0 and b > 0


def test_derivation_recovers_the_model_parameters() -> None:
    s = synthetic()
    o = cal.derive_overrides(s)
    assert o["prefill_base_s"] == pytest.approx(0.003, rel=1e-6)
    assert o["prefill_tok_s"] == pytest.approx(10_000, rel=1e-6)
    assert o["prefill_ctx_growth"] == pytest.approx(2 * 8e-8 / 1e-4 * 1000, rel=1e-6)  # 1.6 per 1k tokens
    assert o["decode_base_s"] == pytest.approx(5e-4, rel=1e-6)
    assert o["decode_ctx_growth"] == pytest.approx(3e-6 / 5e-4 * 1000, rel=1e-6)
    assert o["decode_growth"] == pytest.approx(1.5, rel=1e-6)
    assert o["max_seqs"] == 2 and o["kv_capacity_tokens"] == 2 * cal.CTX_PER_SLOT


def test_derived_overrides_are_a_valid_profile_whose_model_reproduces_the_curve() -> None:
    s = synthetic()
    p = PROFILES["llamacpp"].with_overrides(cal.derive_overrides(s))
    for n in cal.LENGTHS:  # one uncached prompt alone: base + prefill cost
        assert p.step_seconds(0, n) == pytest.approx(s.ttft[n], rel=1e-6)
    longest = max(cal.LENGTHS)
    for prefix in cal.CACHED_PREFIXES:  # the uncached tail is charged at its positions
        assert p.step_seconds(0, longest - prefix, prefill_start=prefix) == pytest.approx(s.cached_ttft[prefix],
                                                                                         rel=1e-6)
    assert p.decode_seconds(2, 2 * s.decode_ctx) == pytest.approx(s.decode_itl_2, rel=1e-6)


def test_shape_ratios() -> None:
    s = synthetic()
    r = cal.shape_ratios(s)
    assert r["ttft(2000)/ttft(100)"] == pytest.approx(s.ttft[2000] / s.ttft[100])
    assert "ttft(100)/ttft(100)" not in r
    assert r["ttft(cached 1800 of 2000)/ttft(uncached)"] == pytest.approx(s.cached_ttft[1800] / s.ttft[2000])
    assert r["queue ttft(3rd,4th)/ttft(1st,2nd) on 2 slots"] == pytest.approx(0.22 / 0.06)
    assert r["decode tok/s, 1 stream"] == pytest.approx(1 / s.decode_itl_1)
    assert r["decode itl 2 streams / 1 stream"] == pytest.approx(s.decode_itl_2 / s.decode_itl_1)


def test_compare_and_tolerance() -> None:
    rows = cal.compare({"x": 2.0, "y": 1.0, "only real": 3.0}, {"x": 2.2, "y": 1.3})
    assert [r.name for r in rows] == ["x", "y"]
    assert rows[0].agreement == pytest.approx(1.1) and rows[0].ok() and not rows[1].ok()
    assert "NO" in cal.table(rows) and "yes" in cal.table(rows)


def test_refine_matches_floor_and_decode_within_bounds() -> None:
    real = synthetic()
    emu = synthetic(a=0.004, d0=2.5e-4)
    o = cal.refine({"prefill_base_s": 0.003, "decode_base_s": 5e-4}, real, emu)
    assert o["prefill_base_s"] == pytest.approx(0.003 + real.floor_ttft - emu.floor_ttft)
    assert 5e-4 < o["decode_base_s"] <= 1e-3  # scaled up, at most x2
    low = cal.refine({"prefill_base_s": 0.0005, "decode_base_s": 5e-4}, real, emu)
    assert low["prefill_base_s"] == 0.0  # never negative


def _run(ttft: float, itl: float = 1e-3, cached: int = 0) -> cal.Run:
    return cal.Run(ttft=ttft, itl=itl, tokens=16, prompt_tokens=100, cached=cached)


def test_summarize_takes_the_best_or_the_median_per_measurement() -> None:
    def workload(scale: float) -> cal.Workload:
        return cal.Workload(
            floor=_run(0.004 * scale), sweep={100: _run(0.015 * scale), 200: _run(0.03 * scale, itl=math.nan)},
            cached={50: _run(0.02 * scale, cached=50)}, decode1=_run(0.004, itl=6e-4 * scale),
            decode2=[_run(0.004, itl=1e-3 * scale), _run(0.008, itl=1.2e-3 * scale)],
            queue=[_run(0.3 * scale), _run(0.04 * scale), _run(0.25 * scale), _run(0.08 * scale)])

    rounds = [workload(1.0), workload(2.0), workload(1.2)]
    best = cal.summarize(rounds)
    assert best.ttft == {100: pytest.approx(0.015), 200: pytest.approx(0.03)}
    assert best.queue_ttft == pytest.approx([0.04, 0.08, 0.25, 0.3])  # sorted by rank
    assert math.isnan(best.itl[200 + cal.SWEEP_TOKENS // 2]) and best.cached_tokens == {50: 50}
    assert best.decode_itl_2 == pytest.approx(1.1e-3)  # mean of the pair, then best round
    med = cal.summarize(rounds, stat="median")
    assert med.ttft[100] == pytest.approx(0.018)


def test_no_nan_in_json() -> None:
    assert cal.no_nan({"a": [math.nan, 1.0], "b": (2.0, math.nan)}) == {"a": [None, 1.0], "b": [2.0, None]}
