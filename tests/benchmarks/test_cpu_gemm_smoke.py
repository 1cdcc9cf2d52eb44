"""Smoke run of benchmarks/cpu_gemm.py on a tiny workload, so the script can't rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_ops

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_gemm.py"


def test_prints_one_row_per_batch_and_weight_state() -> None:
    if not (cpu_ops.cpu_ops_available() and cpu_ops._vnni_available()):
        pytest.skip("no AVX512-BF16 GEMM on this CPU")
    args = ["--rows", "4,12", "--layers", "2", "--rounds", "1"]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    rows = [
        line
        for line in run.stdout.splitlines()
        if line.startswith("| 4 ") or line.startswith("| 12 ")
    ]
    assert len(rows) == 4
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] in ("cold", "hot") and all(float(c) > 0 for c in cells[2:])
