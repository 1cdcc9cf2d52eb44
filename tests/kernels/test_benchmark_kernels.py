"""benchmarks/kernels.py refuses clearly without CUDA and, on a GPU, runs its quick
set and writes only the "## Kernels" section of the docs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_refuses_without_cuda() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr


@pytest.mark.gpu
def test_quick_run_on_a_gpu(tmp_path: Path) -> None:
    out, docs = tmp_path / "k.json", tmp_path / "benchmarks.md"
    docs.write_text("# B\n\n## Kernels\n\n(pending)\n\n## Transfer\n\nkept\n")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--write-docs",
         "--docs-path", str(docs)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["decode"] and res["store"] and res["prefill"] and res["gather"]
    assert all(r["exact"] for r in res["store"])
    assert all(r["max_abs_err"] < 2e-2 for r in res["decode"] + res["prefill"])
    assert all(0 < r["peak_fraction"] < 1.5 for r in res["decode"] + res["store"])
    text = docs.read_text()
    assert "| batch | context |" in text and text.endswith("## Transfer\n\nkept\n")
