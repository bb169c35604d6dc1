"""Adding pre-bucketed values to a prometheus_client histogram gives the exposition observing each would."""

from __future__ import annotations

import bisect

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.telemetry.metrics import ITL_BUCKETS, observe_bucketed

# zero, exactly on bounds (a value equal to a bound is in that bucket: ``le``), between bounds, beyond the last
VALUES = [0.0, 0.0, 0.001, 0.0012, 0.0025, 0.004, 0.0075, 0.011, 0.02, 0.02, 0.049, 0.3, 1.0, 1.5, 7.25, 0.0]


def exposition(fill: str, batches: list[list[float]]) -> list[str]:
    registry = CollectorRegistry()
    h = Histogram("itl_seconds", "ITL.", ["backend", "model"], buckets=ITL_BUCKETS, registry=registry)
    child = h.labels("b", "m")
    for values in batches:
        if fill == "observe":
            for v in values:
                child.observe(v)
        else:
            counts = [0] * (len(ITL_BUCKETS) + 1)
            total = 0.0
            for v in values:
                counts[bisect.bisect_left(ITL_BUCKETS, v)] += 1
                total += v
            observe_bucketed(child, counts, total)
    # ``_created`` (a timestamp, when not disabled process-wide) differs from one histogram to the next
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_one_batch_gives_the_very_exposition_of_observing_each_value() -> None:
    lines = exposition("bucketed", [VALUES])
    assert lines == exposition("observe", [VALUES])
    assert 'itl_seconds_bucket{backend="b",le="0.001",model="m"} 4.0' in lines
    assert f'itl_seconds_count{{backend="b",model="m"}} {float(len(VALUES))}' in lines


def test_batches_accumulate() -> None:
    batches = [VALUES, [0.5, 0.003], [], VALUES[::-1]]
    bucketed, observed = exposition("bucketed", batches), exposition("observe", batches)
    # bucket and count lines are exact; the sum is added per batch, so it may differ in the last bit
    assert [line for line in bucketed if "_sum" not in line] == [line for line in observed if "_sum" not in line]
    (sum_b,) = [float(line.split()[-1]) for line in bucketed if line.startswith("itl_seconds_sum")]
    (sum_o,) = [float(line.split()[-1]) for line in observed if line.startswith("itl_seconds_sum")]
    assert sum_b == pytest.approx(sum_o, rel=1e-12)


def test_counts_must_match_the_histogram() -> None:
    h = Histogram("h", "h", buckets=(0.1, 1.0), registry=CollectorRegistry())
    with pytest.raises(ValueError):
        observe_bucketed(h, [1, 2], 0.5)  # three buckets with +Inf
