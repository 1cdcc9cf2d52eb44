"""Smoke run of benchmarks/engine_isa.py (one forced level, tiny workload, no HF)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_isa.py"

pytestmark = pytest.mark.slow


def test_one_level_writes_its_section(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Engine\n\n(kept)\n\n## Kernels\n\n(kept too)\n")
    args = [
        "--levels", "generic", "--write-docs", "--docs-path", str(docs), "--note", "A note.",
        "--quick", "--skip-hf", "--batch-sizes", "1,2", "--prompt-len", "8", "--gen-len", "3",
        "--ttft-prompt-len", "16", "--repeats", "1",
    ]  # fmt: skip
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    text = docs.read_text()
    engine, isa, kernels = (text.index(h) for h in ("## Engine\n", "## Engine on", "## Kernels"))
    assert engine < isa < kernels and "(kept)" in text and "(kept too)" in text
    section = text[isa:kernels]
    assert "| generic (forced) | f32acc / wide |" in section or "| generic (native) |" in section
    assert "### generic" in section and "A note." in section


def test_an_unknown_level_is_refused() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--levels", "sse9"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "not a level this CPU can run" in run.stderr
