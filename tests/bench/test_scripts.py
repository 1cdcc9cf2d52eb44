"""The benchmark scripts' own parts: docs subsections, tables, plots of several series."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.plot import plot_sweep
from benchmarks import peers, serving_sweep
from benchmarks.docs_section import write_subsection

DOC = """# Benchmarks

## Engine

Engine text.

## Serving

| mode | TTFT |
|---|---|
| agg | 1 |

### Old

old body

### Keep

keep body

## Control plane

cp text
"""


def test_write_subsection_replaces_or_appends_inside_the_section(tmp_path: Path) -> None:
    path = tmp_path / "b.md"
    path.write_text(DOC)
    write_subsection("### Old", "new body", path=path)
    write_subsection("### Added", "added body", path=path)
    text = path.read_text()
    assert "old body" not in text and "### Old\n\nnew body\n\n### Keep" in text
    assert "| agg | 1 |" in text and "keep body" in text  # the rest stays
    serving, control = text.index("## Serving"), text.index("## Control plane")
    assert serving < text.index("### Added") < control
    assert text.endswith("## Control plane\n\ncp text\n")
    write_subsection("### Added", "again", path=path)
    assert path.read_text().count("### Added") == 1


def _row(rate: float | str, good: float, **extra: object) -> dict:
    return {
        "request_rate": rate,
        "completed": 10,
        "failed": 0,
        "request_throughput": 2.0,
        "request_goodput": good,
        "output_throughput": 100.0,
        "p99_ttft_ms": 500.0,
        "p99_tpot_ms": 40.0,
        "p99_e2el_ms": 900.0,
        "total_output_tokens": 1280,
        "median_ttft_ms": 100.0,
        "median_tpot_ms": 20.0,
        "median_itl_ms": 20.0,
        "median_e2el_ms": 800.0,
        "max_concurrent_requests": 4,
        **extra,
    }


def test_peers_table(tmp_path: Path) -> None:
    args = argparse.Namespace(input_len=256, output_len=128, min_prompts=16, prompts_per_slot=3)
    rows = [{"peer": "diptych-aggregated", "concurrency": 1} | _row("inf", 1.0)]
    rows.append({"peer": "llama-cpp-python", "concurrency": 8} | _row("inf", 1.0))
    rows[1]["total_output_tokens"] = 1200
    text = peers.render(rows, {"transformers-serve": "no weights\nmore"}, args, "env.", "cmd")
    assert "| diptych-aggregated | 1 | 10 / 0 |" in text
    assert "100.0 (!)" in text and "(!) the server returned" in text
    assert "| transformers-serve | - | not available here: no weights |" in text


def test_sweep_table_and_plot_of_two_modes(tmp_path: Path) -> None:
    tags = {"short": {"p99_tpot_ms": 30.0}, "long": {"p99_ttft_ms": 2000.0}}
    series = {
        "disaggregated": [_row(1.0, 1.0, per_tag=tags), _row(2.0, 1.5), _row("inf", 0.5)],
        "aggregated": [_row(1.0, 1.0), _row(2.0, 2.0), _row("inf", 1.0)],
    }
    args = argparse.Namespace(
        num_prompts=48,
        short_input_len=96,
        short_output_len=64,
        long_input_len=1024,
        long_output_len=16,
        long_every=8,
        burstiness=1.0,
        goodput=["ttft:3000", "tpot:150"],
    )
    png = plot_sweep(series, tmp_path / "s.png", {"ttft": 3000, "tpot": 150}, "t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = serving_sweep.render(series, args, "env.", "cmd", png)
    assert "| disaggregated | 1.0 | 10 / 0 | 2.00 | 1.00 |" in text
    assert "30.0 | 2000 |" in text
    assert "disaggregated: goodput peaks at 1.50 req/s with 2.0 req/s offered" in text
    assert "aggregated: goodput peaks at 2.00 req/s" in text
