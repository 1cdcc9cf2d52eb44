"""A PNG of a request-rate sweep: TTFT p99, TPOT p99, throughput and goodput vs rate.

Several series (e.g. aggregated and disaggregated) share the axes. SLOs are drawn as
horizontal lines on the latency panels; each series' operating point (the lowest rate
with its highest goodput, where goodput rolls over) is a vertical dotted line on
every panel and a star on the goodput panel. An infinite rate (all requests at once)
sits one step right of the highest finite rate, labelled "inf".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.report import operating_point
from bench.slo import describe

Rows = Sequence[Mapping[str, Any]]


def _rate(row: Mapping[str, Any]) -> float:
    r = row["request_rate"]
    return float("inf") if r == "inf" else float(r)


def _x_positions(series: Mapping[str, Rows]) -> tuple[dict[float, float], bool]:
    rates = {_rate(r) for rows in series.values() for r in rows}
    finite = sorted(r for r in rates if r < math.inf)
    log = len(finite) >= 2 and finite[-1] / finite[0] >= 4
    pos = {r: r for r in finite}
    if math.inf in rates:
        top = finite[-1] if finite else 1.0
        step = finite[-1] - finite[-2] if len(finite) > 1 else 1.0
        pos[math.inf] = top * 2 if log else top + step
    return pos, log


def plot_sweep(
    series: Mapping[str, Rows],
    path: str | Path,
    slos: Mapping[str, float] | None = None,
    title: str = "",
) -> Path:
    """Draw the sweep(s) into `path` (PNG); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'matplotlib>=3.8'") from None
    slos = dict(slos or {})
    pos, log = _x_positions(series)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    panels = [
        (axes[0][0], "p99_ttft_ms", "TTFT p99 (ms)", slos.get("ttft")),
        (axes[0][1], "p99_tpot_ms", "TPOT p99 (ms)", slos.get("tpot")),
        (axes[1][0], "output_throughput", "output throughput (tok/s)", None),
        (axes[1][1], "request_goodput", "goodput (req/s); dashed: throughput", None),
    ]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (label, rows) in enumerate(series.items()):
        color = colors[n % len(colors)]
        rows = sorted(rows, key=_rate)
        xs = [pos[_rate(r)] for r in rows]
        for ax, key, _, _ in panels:
            ys = [r.get(key) for r in rows]
            if all(y is None for y in ys):
                continue
            ax.plot(xs, [math.nan if y is None else y for y in ys], "o-", color=color, label=label)
        axes[1][1].plot(xs, [r["request_throughput"] for r in rows], "--", color=color, alpha=0.6)
        point = operating_point(rows)
        if point is not None:
            x = pos[_rate(point)]
            for ax, *_ in panels:
                ax.axvline(x, color=color, linestyle=":", alpha=0.8)
            axes[1][1].plot(
                [x],
                [point["request_goodput"]],
                "*",
                color=color,
                markersize=16,
                label=f"{label} operating point ({point['request_rate']} req/s)",
            )
    for ax, _, ylabel, slo in panels:
        if slo is not None:
            ax.axhline(slo, color="red", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if log:
            ax.set_xscale("log", base=2)
        ticks = sorted(pos.values())
        ax.set_xticks(ticks)
        inf_x = pos.get(math.inf)
        ax.set_xticklabels(["inf" if x == inf_x else f"{x:g}" for x in ticks])
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("request rate (req/s)")
    head = title or "request-rate sweep"
    fig.suptitle(f"{head}\ngoodput SLOs: {describe(slos)}" if slos else head, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
