"""Every Triton kernel variant the engine launches compiles for sm_90 and sm_80 (PTX
and cubin, through Triton's own compiler and ptxas) and fits the shared memory of
those GPUs; no GPU needed. Runs tests/kernels/compile_check.py in fresh processes
(this one may hold the kernels defined for the interpreter), one per target side by
side: each compilation is one core's work, and the targets share none of it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.kernels.compile_check import EXPECTED_VARIANTS, Variant, check_variants
from tests.kernels.conftest import needs_triton
from tests.kernels.test_isa_levels import Background

ROOT = Path(__file__).resolve().parents[2]
ARCHS = (90, 80)
# the w8a8 variants (FP8 weights, two layouts, a decode row fp32 out or not, and a batch)
FP8_W8A8_VARIANTS = 2 * 3


@needs_triton
@pytest.mark.slow
def test_kernels_compile_for_hopper_and_ampere() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice
    check = [sys.executable, "-m", "tests.kernels.compile_check"]
    runs = {
        arch: Background([*check, "--arch", str(arch)], timeout=900, env=env, cwd=ROOT)
        for arch in ARCHS
    }
    try:
        expected = EXPECTED_VARIANTS[False]
        for arch, run in runs.items():
            proc = run.result()
            assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-4000:]
            summary = re.search(
                r"^(\d+) variants x (\d+) targets in \d+ s, (\d+) compiled, "
                r"(\d+) not for the target, (\d+) failures$",
                proc.stdout,
                re.MULTILINE,
            )
            assert summary, proc.stdout[-2000:]
            variants, targets, compiled, skipped, failures = map(int, summary.groups())
            assert variants == expected > 0
            assert (targets, failures) == (1, 0)
            # w8a8's FP8 dots are for Hopper (and Ada), not Ampere: every variant
            # compiles for sm_90, all but those for sm_80
            assert compiled + skipped == expected and (skipped == 0) == (arch >= 89)
            assert skipped == (0 if arch >= 89 else FP8_W8A8_VARIANTS)
            # one "ok" line per compilation, each for the target asked for
            ok = re.findall(r"^ok   sm_(\d+) ", proc.stdout, re.MULTILINE)
            assert ok == [str(arch)] * compiled
    finally:
        for run in runs.values():
            run.kill()


def test_the_check_fails_on_zero_or_unexpected_variants() -> None:
    """A run that records nothing (or not what it should) must not pass."""
    with pytest.raises(RuntimeError, match="no kernel variant was recorded"):
        check_variants([], EXPECTED_VARIANTS[False])
    with pytest.raises(RuntimeError, match="no kernel variant was recorded"):
        check_variants([], 0)
    one = Variant("a case", None, {}, {}, {}, {})
    with pytest.raises(RuntimeError, match="1 kernel variants recorded, 2 expected"):
        check_variants([one], 2)
    check_variants([one], 1)
