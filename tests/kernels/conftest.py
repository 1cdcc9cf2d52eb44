"""Kernel tests run the Triton kernels compiled on a CUDA device when there is one,
and through Triton's interpreter on CPU tensors when there is not.

Triton fixes interpretation when a jit function is defined, its own standard library
(`tl.sum`, ...) included, so TRITON_INTERPRET=1 must be set before `triton` is first
imported. This conftest is imported while pytest collects, before any test runs and
(checked below) before anything else imports triton: it sets the variable, imports
triton and `kernels.triton` and launches one tiny kernel (which pulls in the modules
triton imports lazily), then restores the environment, so processes that later tests
spawn do not inherit it. Other test directories are unaffected: on CPU the automatic
dispatch of `kernels.ops` never reaches Triton.

Without the triton package these tests skip, unless DIPTYCH_REQUIRE_TRITON=1 (CI),
which makes that an error.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from kernels.ops import Kernels


def _load() -> ModuleType | None:
    try:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return None
    except (ImportError, ValueError):
        return None
    if torch.cuda.is_available():
        import kernels.triton as kt

        return kt
    if "triton" in sys.modules and "kernels.triton" not in sys.modules:
        from triton.language import standard
        from triton.runtime.jit import JITFunction

        if isinstance(standard.sum, JITFunction):
            raise RuntimeError(
                "triton was imported before tests/kernels/conftest.py could switch on its "
                "interpreter; run the kernel tests on their own or with TRITON_INTERPRET=1"
            )
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import kernels.triton as kt

        x = torch.zeros(2, 4)
        kt.silu_and_mul(x)  # first launch: triton's lazy imports happen in interpreter mode
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return kt


KT = _load()
if KT is None and os.environ.get("DIPTYCH_REQUIRE_TRITON") == "1":
    raise RuntimeError("DIPTYCH_REQUIRE_TRITON=1 but the triton package is not installed")

# where the Triton kernels run in these tests: compiled on CUDA, else interpreted on CPU
DEVICE = torch.device("cuda" if KT is not None and not KT.INTERPRETED else "cpu")

needs_triton = pytest.mark.skipif(KT is None, reason="triton is not installed")

# fp32 and fp16 everywhere; bf16 arithmetic is wrong in the interpreter, so it runs on GPUs
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bfloat16"),
]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def kernels_for(backend: str) -> Kernels:
    """The engine's ops on kernel backend `backend` ("auto", "torch" or "triton")."""
    from kernels.ops import Kernels, KernelSelection

    return Kernels(KernelSelection(backend))


@pytest.fixture
def triton_ops() -> Kernels:
    """The engine's ops forced to the Triton kernels."""
    return kernels_for("triton")
