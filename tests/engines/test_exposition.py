"""The scrape's exposition reader against prometheus_client's own writer and parser: the same sums and the same
histograms on expositions with many label sets and awkward label values, and the lines it must not take for
samples."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.engines.base import parse_histogram, parse_metrics
from gateway.engines.exposition import histogram, samples, summed

pytestmark = pytest.mark.unit

# label values a real engine may write: a "}" and a quote inside, spaces, a backslash, a newline (escaped)
AWKWARD = ['plain', 'with } brace', 'a "quoted" word', 'back\\slash', 'two\nlines', 'le="9"', '']


def exposition() -> str:
    """What vLLM's /metrics looks like to a reader: gauges, counters and histograms with several label sets,
    names that start with one another, and families the scrape does not want, written by prometheus_client."""
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "running", ["model_name", "engine"], registry=registry)
    Gauge("vllm:num_requests_running_max", "a longer name that starts with a wanted one", registry=registry).set(99)
    waiting = Gauge("vllm:num_requests_waiting", "waiting", ["model_name", "engine"], registry=registry)
    tokens = Counter("vllm:prompt_tokens", "prompt tokens", ["model_name"], registry=registry)
    queue = Histogram("vllm:request_queue_time_seconds", "queue time", ["model_name", "engine"],
                      buckets=(0.001, 0.01, 0.1, 0.3, 1.0, 2.5, 10.0), registry=registry)
    other = Histogram("vllm:e2e_request_latency_seconds", "not wanted", ["model_name"], registry=registry)
    for i, label in enumerate(AWKWARD):
        for engine in ("0", "1"):
            running.labels(label, engine).set(i + 1)
            waiting.labels(label, engine).set(0.5 * i)
            for value in (0.0005, 0.02 * i, 0.4, 3.0 + i):
                queue.labels(label, engine).observe(value)
        tokens.labels(label).inc(100 * i + 7)
        other.labels(label).observe(1.5)
    return generate_latest(registry).decode()


def parsed_sums(text: str, names: set[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def parsed_histogram(text: str, name: str) -> tuple[tuple[tuple[str, float], ...], float, float]:
    for family in text_string_to_metric_families(text):
        if family.name == name:
            buckets: dict[str, float] = {}
            total = count = 0.0
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[sample.labels["le"]] = buckets.get(sample.labels["le"], 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
                elif sample.name.endswith("_count"):
                    count += sample.value
            return tuple(sorted(buckets.items(), key=lambda kv: float(kv[0]))), total, count
    raise AssertionError(f"{name} not in the exposition")


def test_the_same_sums_and_histograms_as_prometheus_clients_parser() -> None:
    text = exposition()
    wanted = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
              "vllm:request_queue_time_seconds_count", "vllm:absent"}
    expected = parsed_sums(text, wanted)
    assert expected["vllm:num_requests_running"] == 2 * sum(range(1, len(AWKWARD) + 1))
    assert parse_metrics(text, wanted) == summed(text, wanted) == expected  # ("vllm:absent" left out by both)
    queue = parse_histogram(text, "vllm:request_queue_time_seconds")
    assert queue == parsed_histogram(text, "vllm:request_queue_time_seconds")
    assert queue is not None and queue[0][-1] == ("+Inf", 4 * 2 * len(AWKWARD))
    assert parse_histogram(text, "vllm:absent_seconds") is None


def test_only_sample_lines_of_the_wanted_names_are_read() -> None:
    text = "\r\n".join([
        "# HELP up up 7",  # a comment naming it
        "# TYPE up gauge",
        "up 1",
        "up_and_down 50",  # a longer name
        "upper{x=\"1\"} 60",
        "  up 2",  # (indented: not a sample line as Prometheus writes them)
        "up{job=\"a b\",path=\"/}\"} 3 1700000000000",  # a timestamp after the value
        "up{job=\"c\"} NaN",
        "up{job=\"d\"} +Inf",
        "x 1\nup 4",  # (no newline at the end of the text)
    ])
    found = list(samples(text, ["up"]))
    assert [(labels, value) for _, labels, value in found[:2]] == [("", 1.0), ('job="a b",path="/}"', 3.0)]
    assert math.isnan(found[2][2]) and found[3][2] == math.inf and found[4][1:] == ("", 4.0)
    assert len(found) == 5


@pytest.mark.parametrize("line", ['up{job="e"} not-a-number', 'up{job="f"}', "up ", 'up{job="g" 1'])
def test_a_wanted_series_line_that_is_not_a_sample_is_an_error(line: str) -> None:
    with pytest.raises(ValueError):
        list(samples(f"other 1\n{line}\n", ["up"]))
    assert list(samples(f"other 1\n{line}\n", ["other"])) == [("other", "", 1.0)]  # (others' lines unread)


@pytest.mark.parametrize("labels", ['le="0.5"', 'engine="0",le="0.5"', 'handle="x",le = "0.5"'])
def test_a_bucket_bound_is_the_le_label_and_no_other(labels: str) -> None:
    text = (f"h_bucket{{{labels}}} 2\nh_bucket{{handle=\"1\",le=\"+Inf\"}} 3\nh_bucket{{le=\"oops\"}} 9\n"
            "h_sum 1.25\nh_count 3\n")
    assert histogram(text, "h") == ((("0.5", 2.0), ("+Inf", 3.0)), 1.25, 3.0)
