"""Smoke run of benchmarks/cpu_gemm.py on a tiny workload, so the script can't rot."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kernels import cpu_ops
from tests import child

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_gemm.py"


def test_prints_one_row_per_batch_and_weight_state() -> None:
    if not cpu_ops.cpu_ops_available():
        pytest.skip("no C++ CPU ops")
    args = ["--rows", "4,12", "--layers", "2", "--rounds", "1"]
    run = child.run([sys.executable, str(SCRIPT), *args], timeout=300)
    assert run.returncode == 0, run.stderr
    rows = [
        line
        for line in run.stdout.splitlines()
        if line.startswith("| 4 ") or line.startswith("| 12 ")
    ]
    assert len(rows) == 4
    (header,) = [line for line in run.stdout.splitlines() if line.startswith("| rows ")]
    names = [c.strip() for c in header.strip("|").split("|")][2:]
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] in ("cold", "hot")
        for name, cell in zip(names, cells[2:], strict=True):
            # the GEMV serves only small batches: above cpu_ops.SMALL_M_MAX rows it is not
            # run (on a CPU without bf16 instructions, where it is a column)
            small = int(cells[0]) <= cpu_ops.SMALL_M_MAX
            if cell == "n/a":
                assert name == "Diptych GEMV" and not small, (name, line)
            else:  # GFLOP/s to the unit: a loaded machine may print 0 for the cold pass
                assert float(cell) >= 0, (name, line)


def test_a_level_without_bf16_instructions_compares_against_fp32() -> None:
    """Forced to avx2 the script measures the widening kernels against torch's fp32."""
    from kernels import cpu_isa

    if cpu_isa.LEVELS.index(cpu_isa.probe().native) < cpu_isa.LEVELS.index("avx2"):
        pytest.skip("this CPU has no avx2 level")
    env = {**os.environ, **cpu_isa.forced_environment("avx2")}
    args = ["--rows", "4", "--layers", "2", "--rounds", "1"]
    run = child.run([sys.executable, str(SCRIPT), *args], timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "ISA level avx2" in run.stdout and "Diptych f32acc GEMM" in run.stdout
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 4 ")]
    assert len(rows) == 2 and all("n/a" not in line for line in rows)
