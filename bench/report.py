"""The terminal table of a run (laid out like `vllm bench serve`'s), and a sweep summary."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from bench.metrics import percentile_word
from bench.slo import describe

_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "ttfa": ("TTFA", "Time to Final Answer (after thinking)"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive E2EL"),
}


def _row(name: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{name:<40} {value:<10.2f}"
    return f"{name:<40} {value!s:<10}"


def format_result(
    result: Mapping[str, Any], percentiles: Sequence[float], errors: Sequence[str] = ()
) -> str:
    """The block printed after each run."""
    lines = [" Serving Benchmark Result ".center(50, "=")]
    rows: list[tuple[str, Any]] = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
    ]
    if result.get("max_concurrency") is not None:
        rows.append(("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        rows.append(("Request rate configured (RPS):", float(result["request_rate"])))
    rows += [
        ("Benchmark duration (s):", float(result["duration"])),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
    ]
    if result.get("total_cached_tokens") is not None:  # the server's usage said
        rows += [("Prompt tokens found cached:", result["total_cached_tokens"]),
                 ("Prompt tokens prefilled:", result["total_prefilled_tokens"])]  # fmt: skip
    rows += [
        ("Request throughput (req/s):", float(result["request_throughput"])),
    ]
    if result.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s):", float(result["request_goodput"])))
    rows += [
        ("Output token throughput (tok/s):", float(result["output_throughput"])),
        ("Peak output token throughput (tok/s):", float(result["max_output_tokens_per_s"])),
        ("Peak concurrent requests:", float(result["max_concurrent_requests"])),
        ("Total token throughput (tok/s):", float(result["total_token_throughput"])),
    ]
    if result.get("total_reasoning_tokens"):  # a reasoning model's thinking
        rate = float(result["reasoning_throughput"])
        rows += [("Total reasoning tokens:", result["total_reasoning_tokens"]),
                 ("Reasoning token throughput (tok/s):", rate)]  # fmt: skip
    lines += [_row(n, v) for n, v in rows]
    if result.get("goodput_config"):
        lines.append(f"{'Goodput SLOs:':<40} {describe(result['goodput_config'])}")
    for key, (short, header) in _HEADERS.items():
        if f"mean_{key}_ms" not in result:
            continue
        lines.append(header.center(50, "-"))
        lines.append(_row(f"Mean {short} (ms):", float(result[f"mean_{key}_ms"])))
        lines.append(_row(f"Median {short} (ms):", float(result[f"median_{key}_ms"])))
        for p in percentiles:
            w = percentile_word(p)
            lines.append(_row(f"P{w} {short} (ms):", float(result[f"p{w}_{key}_ms"])))
    if result.get("per_tag"):
        lines.append(" Per request class ".center(50, "-"))
        lines.append(format_tags(result["per_tag"]))
    errors = [e for e in errors if e]
    if errors:
        lines.append(f"Errors of failed requests (first {min(10, len(errors))}):")
    for i, err in enumerate(errors[:10]):
        lines.append(f"  {i}: {err}")
    lines.append("=" * 50)
    return "\n".join(lines)


_TAG_KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "p99_e2el_ms")


def format_tags(per_tag: Mapping[str, Mapping[str, Any]]) -> str:
    out = [
        f"{'class':<8} {'done':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'E2EL p99':>9}"
    ]
    for tag, m in per_tag.items():
        cells = [m.get(k, float("nan")) for k in _TAG_KEYS]
        out.append(f"{tag:<8} {m['completed']:>5} " + " ".join(f"{c:>9.1f}" for c in cells))
    return "\n".join(out)


def format_sweep(rows: Sequence[Mapping[str, Any]], slos: Mapping[str, float]) -> str:
    """One line per request rate, and the operating point when SLOs were given."""
    head = (
        f"{'rate':>6} {'done':>5} {'fail':>4} {'req/s':>7} {'good/s':>7} {'tok/s':>8} "
        f"{'TTFT p99':>9} {'TPOT p99':>9} {'E2EL p99':>9}"
    )
    lines = [" Request-rate sweep ".center(len(head), "="), head]
    for r in rows:
        good = r.get("request_goodput")
        lines.append(
            f"{r['request_rate']!s:>6} {r['completed']:>5} {r['failed']:>4} "
            f"{r['request_throughput']:>7.2f} "
            f"{'-' if good is None else f'{good:.2f}':>7} {r['output_throughput']:>8.1f} "
            f"{_get(r, 'p99_ttft_ms'):>9.1f} {_get(r, 'p99_tpot_ms'):>9.1f} "
            f"{_get(r, 'p99_e2el_ms'):>9.1f}"
        )
    if slos:
        point = operating_point(rows)
        lines.append(f"Goodput SLOs: {describe(slos)}")
        if point is not None:
            lines.append(
                f"Operating point: {point['request_rate']} req/s offered, "
                f"goodput {point['request_goodput']:.2f} req/s (where goodput peaks)"
            )
    return "\n".join(lines)


def _get(row: Mapping[str, Any], key: str) -> float:
    value = row.get(key)
    return float("nan") if value is None else float(value)


def operating_point(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The lowest rate with the highest goodput: past it goodput rolls over or flattens."""
    best: Mapping[str, Any] | None = None
    for r in rows:
        good = r.get("request_goodput")
        if good is None or (isinstance(good, float) and math.isnan(good)):
            continue
        if best is None or good > best["request_goodput"] + 1e-12:
            best = r
    return best
