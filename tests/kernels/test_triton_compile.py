"""Every Triton kernel variant the engine launches compiles for sm_90 and sm_80 (PTX
and cubin, through Triton's own compiler and ptxas) and fits the shared memory of
those GPUs; no GPU needed. Runs tests/kernels/compile_check.py in a fresh process:
this one may hold the kernels defined for the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.conftest import needs_triton

ROOT = Path(__file__).resolve().parents[2]


@needs_triton
@pytest.mark.slow
def test_kernels_compile_for_hopper_and_ampere() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.compile_check", "--arch", "90", "--arch", "80"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
    assert " 0 failures" in proc.stdout
