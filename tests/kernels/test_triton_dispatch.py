"""Dispatch rules of `kernels.ops.KernelSelection` (through `kernels.ops.Kernels`) and of the
attention backend registry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention import TorchAttention, TritonAttention, get_backend_class
from kernels import ops
from kernels.ops import Kernels, KernelSelection
from kernels.paged import PagedBatch, PagedLayer
from tests.kernels.conftest import KT, kernels_for, needs_triton

pytestmark = needs_triton
ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the Triton launchers the ops call during the test."""
    called: list[str] = []
    assert KT is not None
    for name in ("rms_norm", "rotary_", "silu_and_mul", "store_kv", "unified_attention"):
        real = getattr(KT, name)

        def wrapper(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            called.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(KT, name, wrapper)
    return called


def _exercise(kernels: Kernels, dtype: torch.dtype = torch.float32) -> None:
    x = torch.randn(3, 64).to(dtype)
    kernels.rms_norm(x, x, torch.ones(64, dtype=dtype), 1e-6)
    kernels.silu_and_mul(x)
    q = torch.randn(3, 2, 32).to(dtype)
    cos, sin = torch.ones(3, 16), torch.zeros(3, 16)
    kernels.rotary_(q, cos, sin)
    pool = torch.zeros(4, 2, 16, 2, 32, dtype=dtype)
    kernels.store_kv(q, q, pool[:, 0], pool[:, 1], torch.tensor([1, 2, 3]))
    batch = PagedBatch(
        torch.tensor([1, 2, 3], dtype=torch.int32), torch.ones(3, 1, dtype=torch.int32)
    )
    kernels.unified_attention(q, PagedLayer(pool[:, 0], pool[:, 1], 0.1), batch)


def test_auto_on_cpu_never_reaches_triton(spy: list[str]) -> None:
    _exercise(kernels_for("auto"))
    assert spy == []


def test_forced_triton_runs_every_kernel_on_cpu_tensors(
    spy: list[str], triton_ops: Kernels
) -> None:
    _exercise(triton_ops)
    assert spy == ["rms_norm", "silu_and_mul", "rotary_", "store_kv", "unified_attention"]


def test_forced_torch_uses_the_references(spy: list[str]) -> None:
    _exercise(kernels_for("torch"))
    assert spy == []


def test_interpreter_refuses_bf16_arithmetic_but_copies_it(triton_ops: Kernels) -> None:
    assert KT is not None
    if not KT.INTERPRETED:
        pytest.skip("compiled kernels compute bf16 correctly")
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="interpreter computes bfloat16 wrongly"):
        triton_ops.silu_and_mul(x)
    pool = torch.zeros(4, 2, 16, 1, 64, dtype=torch.bfloat16)
    k = x.view(2, 1, 64)
    triton_ops.store_kv(k, k, pool[:, 0], pool[:, 1], torch.tensor([0, 17]))
    assert torch.equal(pool[1, 0, 1, 0], x[1])


def test_selection_validates_and_is_immutable() -> None:
    with pytest.raises(ValueError, match="one of auto, torch, triton"):
        KernelSelection("cuda")
    assert KernelSelection.parse(None) == KernelSelection("auto")
    assert KernelSelection.parse(" Torch ") == KernelSelection("torch")
    assert KernelSelection.from_env({"DIPTYCH_KERNELS": "triton"}).backend == "triton"
    assert KernelSelection.from_env({}).backend == "auto"
    selection = KernelSelection("torch")
    with pytest.raises(AttributeError):
        selection.backend = "auto"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        Kernels(selection).selection = KernelSelection("triton")  # type: ignore[misc]
    # the module-level ops are the default's, selected once from the environment
    assert ops.rms_norm == ops.DEFAULT.rms_norm
    assert ops.get_backend() == ops.DEFAULT.selection.backend


def test_backend_registry() -> None:
    auto, triton = KernelSelection("auto"), KernelSelection("triton")
    assert get_backend_class("auto", CPU, auto) is TorchAttention
    assert get_backend_class("torch", CPU, auto) is TorchAttention
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend_class("triton", CPU, auto)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend_class("flash", CPU, auto)
    assert get_backend_class("triton", CPU, triton) is TritonAttention
    assert get_backend_class("auto", CPU, triton) is TorchAttention  # auto: torch path on CPU


def test_a_backend_runs_the_kernels_it_is_given(spy: list[str], triton_ops: Kernels) -> None:
    """The ops of an attention backend are the `Kernels` it was built with, whatever
    the process default is."""
    from engine.attention import BatchLayout

    assert TorchAttention(2, 2, 32, 0.1).kernels is ops.DEFAULT
    backend = TritonAttention(2, 2, 32, 0.1, kernels=triton_ops)
    layout = BatchLayout.build([1, 2], [3, 0], [[1], [2]], 16, CPU)
    meta = backend.prepare(layout)
    q, k = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    out = backend.forward(q, k, k, torch.zeros(4, 2, 16, 2, 32), meta)
    assert out.shape == (3, 64)
    assert spy == ["store_kv", "unified_attention"]


@pytest.mark.gpu
def test_auto_picks_triton_on_cuda() -> None:
    cuda = torch.device("cuda")
    assert get_backend_class("auto", cuda, KernelSelection("auto")) is TritonAttention
    assert get_backend_class("auto", cuda, KernelSelection("torch")) is TorchAttention


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DIPTYCH_KERNELS")}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_environment_flag() -> None:
    """DIPTYCH_KERNELS is read at import: bad values fail clearly; "triton" on CPU
    tensors needs the interpreter, and with it runs the Triton kernels."""
    bad = _python("import kernels.ops", DIPTYCH_KERNELS="fast")
    assert bad.returncode != 0 and "one of auto, torch, triton" in bad.stderr
    code = (
        "import torch; from kernels import ops; print(ops.get_backend());"
        "print(ops.silu_and_mul(torch.ones(1, 4)).tolist())"
    )
    if not torch.cuda.is_available():
        no_interp = _python(code, DIPTYCH_KERNELS="triton")
        assert no_interp.returncode != 0 and "TRITON_INTERPRET=1" in no_interp.stderr
        registry = _python(
            "import torch; from engine.attention import get_backend_class;"
            "get_backend_class('triton', torch.device('cpu'))",
            DIPTYCH_KERNELS="triton",
        )
        assert registry.returncode != 0 and "needs a CUDA device" in registry.stderr
    ok = _python(code, DIPTYCH_KERNELS="triton", TRITON_INTERPRET="1")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.split("\n")[:2] == ["triton", "[[0.7310585975646973, 0.7310585975646973]]"]
