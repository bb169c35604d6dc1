"""The comparison as a table, a JSON summary and a chart."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gateway.llamacpp.calibrate.common import (
    FLOOR_LENGTH,
    QUEUE_PROMPT,
    TOLERANCE,
    Summary,
)
from gateway.llamacpp.calibrate.fit import (
    Row,
)


def table(rows: Sequence[Row], tolerance: float = TOLERANCE) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'shape':<{width}}  {'real':>10}  {'emulated':>10}  {'emu/real':>8}  ok",
             "-" * (width + 40)]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.real:>10.3f}  {r.emulated:>10.3f}  {r.agreement:>8.3f}  "
                     f"{'yes' if r.ok(tolerance) else 'NO'}")
    return "\n".join(lines)


def measured_figures(s: Summary) -> dict[str, float]:
    """Headline figures of one server, for the report."""
    longest = max(s.ttft)
    out = {f"ttft {n} tokens (ms)": 1000 * v for n, v in s.ttft.items()}
    out["ttft 16 tokens (ms)"] = 1000 * s.floor_ttft
    out[f"prefill tok/s at {longest} tokens"] = longest / s.ttft[longest]
    for n, v in s.cached_ttft.items():
        out[f"cached {n} of {longest}: ttft (ms)"] = 1000 * v
        out[f"cached {n} of {longest}: saving (%)"] = 100 * (1 - v / s.ttft[longest])
        out[f"cached {n} of {longest}: cached tokens reported"] = s.cached_tokens[n]
    out["decode tok/s, 1 stream, short context"] = 1 / s.decode_itl_1
    out["decode tok/s per stream, 2 streams"] = 1 / s.decode_itl_2
    for ctx, v in s.itl.items():
        out[f"decode tok/s at context {ctx}"] = 1 / v
    for i, v in enumerate(s.queue_ttft):
        out[f"queue request {i + 1} ttft (ms)"] = 1000 * v
    return out


def chart(path: Path, real: Summary, emu: Summary) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    for s, label, style in ((real, "real llama-server", "o-"), (emu, "emulator", "s--")):
        xs = [FLOOR_LENGTH, *sorted(s.ttft)]
        ax.plot(xs, [1000 * s.floor_ttft] + [1000 * s.ttft[n] for n in sorted(s.ttft)], style, label=label)
    ax.set(title="TTFT vs prompt length (uncached)", xlabel="prompt tokens", ylabel="ms")
    ax.legend()
    ax = axes[0][1]
    longest = max(real.ttft)
    names = ["uncached"] + [f"{n} cached" for n in sorted(real.cached_ttft)]
    rv = [1000 * real.ttft[longest]] + [1000 * real.cached_ttft[n] for n in sorted(real.cached_ttft)]
    ev = [1000 * emu.ttft[longest]] + [1000 * emu.cached_ttft[n] for n in sorted(emu.cached_ttft)]
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], rv, 0.4, label="real")
    ax.bar([x + 0.2 for x in xs], ev, 0.4, label="emulator")
    ax.set_xticks(xs, names)
    ax.set(title=f"TTFT of a {longest}-token prompt, prefix cached", ylabel="ms")
    ax.legend()
    ax = axes[1][0]
    xs = list(range(1, len(real.queue_ttft) + 1))
    ax.bar([x - 0.2 for x in xs], [1000 * v for v in real.queue_ttft], 0.4, label="real")
    ax.bar([x + 0.2 for x in xs], [1000 * v for v in emu.queue_ttft], 0.4, label="emulator")
    ax.set(title=f"{len(xs)} concurrent requests on {real.slots} slots ({QUEUE_PROMPT}-token prompts)",
           xlabel="request (by TTFT)", ylabel="TTFT ms")
    ax.legend()
    ax = axes[1][1]
    for s, label, style in ((real, "real llama-server", "o-"), (emu, "emulator", "s--")):
        pts = {**s.itl, s.decode_ctx: s.decode_itl_1}
        ax.plot(sorted(pts), [1000 * pts[c] for c in sorted(pts)], style, label=label)
    ax.set(title="inter-token time vs context (1 stream)", xlabel="context tokens", ylabel="ms per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
