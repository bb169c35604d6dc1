"""The few samples the gateway reads from an engine's ``/metrics``, found without parsing the rest.

A scrape wants two to four series out of an exposition of hundreds (vLLM exports dozens of histograms, each a
line per bucket and label set). prometheus_client's parser builds every family and sample in Python: 13 ms for
the vLLM emulator's 12 KB, twice per scrape (the load gauges, then the queue histogram), on the event loop that
carries every stream, once a second per backend. Here ``str.find`` (C) looks for each wanted sample name;
only the lines that start with one are read, turned into numbers (and only a histogram's bucket lines have a
label read: ``le``).

It reads the text format (``text/plain; version=0.0.4``) as Prometheus does: a sample line is the sample's
name, its labels in braces (a label value may hold any character, ``}`` included, and a quote escaped as
``\\"``), the value, and an optional timestamp; comment lines (``#``) and every other series are skipped unread.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator

# lines starting with a wanted series' name one reading may hold: vLLM's queue-time histogram is ~20 bucket lines
# per label set (model, engine rank); an exposition of 70,000 wanted lines (4 MiB) took ~0.3 s of the event loop
# at every scrape, for every tenant (sweep 16). Past this it is not an engine's exposition: the reading is refused.
MAX_SAMPLES = 10_000


def samples(text: str, names: Collection[str]) -> Iterator[tuple[str, str, float]]:
    """(sample name, the text between its braces, value) of each sample of ``text`` named in ``names``,
    grouped by name. Lines that do not start with a wanted name (comments, other series, a longer name that
    starts with a wanted one) are skipped unread; a wanted series' line that is not a sample (labels without
    their closing brace, no value, a value that is not a number) raises ValueError: the engine's /metrics is
    not what it should be, as does a ``text`` with more than ``MAX_SAMPLES`` lines starting with a wanted name."""
    end_of_text = len(text)
    read = 0
    for name in set(names):
        size = len(name)
        at = text.find(name)
        while at >= 0:
            after = at + size
            line_end = text.find("\n", after)
            if line_end < 0:
                line_end = end_of_text
            if at == 0 or text[at - 1] == "\n":  # (a sample line starts with its name; "# HELP name" does not)
                read += 1  # (every line starting with a wanted name: one that is no sample costs its reading too)
                if read > MAX_SAMPLES:
                    raise ValueError(f"more than {MAX_SAMPLES} lines of the series read")
                rest = text[after:line_end]
                if rest.startswith("{"):
                    # the labels end at the line's last "}" (the value and timestamp hold none), so a "}" in a
                    # quoted label value does not end them early
                    close = rest.rfind("}")
                    if close < 0:
                        # (the line itself is not quoted: an engine's text reaches the logs only whole and scrubbed)
                        raise ValueError(f"{name}: labels without their closing brace (line "
                                         f"{text.count(chr(10), 0, at) + 1})")
                    labels, tail = rest[1:close], rest[close + 1:]
                elif rest[:1].isspace():
                    labels, tail = "", rest
                else:
                    labels, tail = "", None  # (another series whose name starts with this one)
                if tail is not None:
                    value = tail.split(None, 1)
                    if not value:
                        raise ValueError(f"{name}: a sample without a value")
                    try:
                        number = float(value[0])
                    except ValueError:
                        raise ValueError(f"{name}: a value that is not a number (line "
                                         f"{text.count(chr(10), 0, at) + 1})") from None
                    yield name, labels, number
            at = text.find(name, line_end)


def label(labels: str, name: str) -> str | None:
    """The value of label ``name`` in a sample's label text (as :func:`samples` gives it), escapes left as
    written; None when it has none."""
    found = re.search(rf'(?:^|,)[ \t]*{re.escape(name)}[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"', labels)
    return found.group(1) if found is not None else None


def summed(text: str, names: Collection[str], largest: Collection[str] = ()) -> dict[str, float]:
    """Each wanted sample name's values summed across its label sets (engine ranks, models), or for a name in
    ``largest`` the largest of them (a share per rank, as KV-cache use: two ranks at 60% are 60%, not 120%);
    absent names are left out."""
    out: dict[str, float] = {}
    for name, _, value in samples(text, names):
        if name not in out:
            out[name] = value
        elif name in largest:
            out[name] = max(out[name], value)
        else:
            out[name] += value
    return out


def histogram(text: str, name: str) -> tuple[tuple[tuple[str, float], ...], float, float] | None:
    """A histogram summed across its label sets: ((le, cumulative count), ...) in bucket order, its sum, its
    count; None when it has no bucket in ``text``."""
    bucket_name = f"{name}_bucket"
    buckets: dict[str, float] = {}
    total = count = 0.0
    for sample, labels, value in samples(text, (bucket_name, f"{name}_sum", f"{name}_count")):
        if sample == bucket_name:
            le = label(labels, "le") or "+Inf"
            try:
                float(le)
            except ValueError:
                continue  # (a bucket without a bound is no bucket)
            buckets[le] = buckets.get(le, 0.0) + value
        elif sample.endswith("_sum"):
            total += value
        else:
            count += value
    if not buckets:
        return None
    return tuple(sorted(buckets.items(), key=lambda kv: float(kv[0]))), total, count
