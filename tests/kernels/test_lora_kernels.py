"""The LoRA delta of a mixed batch (`kernels.lora`): the C++ BGMV kernel and the Triton
shrink/expand kernels (through the interpreter) against the torch reference, and the
reference against the plain per-adapter formula B(A x) * alpha / r."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import cpu_ops, lora
from tests.kernels.conftest import needs_triton


def _case(
    dtype: torch.dtype, t: int = 11, k: int = 40, rank: int = 8, slots: int = 3,
    bounds: tuple[int, ...] = (0, 24, 32, 40), seed: int = 0,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    j, n = len(bounds) - 1, bounds[-1]
    x = torch.randn(t, k, generator=g).to(dtype)
    a = torch.randn(slots, j * rank, k, generator=g).to(dtype)
    b = (torch.randn(slots, rank, n, generator=g) * 0.5).to(dtype)
    out = torch.randn(t, n, generator=g).to(dtype)
    idx = torch.randint(-1, slots, (t,), generator=g)
    idx[0], idx[1] = -1, slots - 1  # a base row and the last slot, always
    return out, x, a, b, idx


def test_reference_is_the_per_adapter_formula() -> None:
    bounds = (0, 24, 32, 40)
    out, x, a, b, idx = _case(torch.float32, bounds=bounds)
    want = out.clone()
    for t in range(x.shape[0]):
        s = int(idx[t])
        if s < 0:
            continue
        for jj, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            a_j = a[s, jj * 8 : (jj + 1) * 8]  # [r, K]
            b_j = b[s, :, lo:hi].t()  # [out_j, r]
            want[t, lo:hi] += b_j @ (a_j @ x[t])
    got = lora.lora_add_reference(out.clone(), x, a, b, idx, bounds)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], out[0])  # a base row is untouched


@pytest.mark.skipif(not cpu_ops.cpu_ops_available(), reason="the C++ ops did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [
    dict(t=11, k=40, rank=8, bounds=(0, 24, 32, 40)),  # tails everywhere
    dict(t=33, k=64, rank=16, bounds=(0, 96)),  # one slice, aligned
    dict(t=5, k=48, rank=4, bounds=(0, 50, 100)),  # gate/up-like
])  # fmt: skip
def test_cpu_kernel_matches_reference(dtype: torch.dtype, shape: dict) -> None:
    out, x, a, b, idx = _case(dtype, **shape)
    want = lora.lora_add_reference(out.clone(), x, a, b, idx, shape["bounds"])
    for index in (idx, idx.to(torch.int32)):
        got = out.clone()
        torch.ops.diptych_cpu.lora_add_(got, x, a, b, index, list(shape["bounds"]))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.skipif(not cpu_ops.cpu_ops_available(), reason="the C++ ops did not build")
def test_cpu_kernel_refuses_a_slot_out_of_range() -> None:
    out, x, a, b, idx = _case(torch.float32)
    idx[2] = 7
    with pytest.raises(RuntimeError, match="slot 7 of 3"):
        torch.ops.diptych_cpu.lora_add_(out, x, a, b, idx, [0, 24, 32, 40])


def test_reference_refuses_bad_bounds() -> None:
    out, x, a, b, idx = _case(torch.float32)
    with pytest.raises(ValueError, match="bounds"):
        lora.lora_add_reference(out, x, a, b, idx, (0, 24, 40, 32))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bounds", [(0, 24, 32, 40), (0, 150), (0, 130, 260)])
def test_triton_kernels_match_reference(dtype: torch.dtype, bounds: tuple[int, ...]) -> None:
    import kernels.triton as kt

    out, x, a, b, idx = _case(dtype, k=136, rank=8 if len(bounds) == 4 else 20, bounds=bounds)
    want = lora.lora_add_reference(out.clone(), x, a, b, idx, bounds)
    for index in (idx, idx.to(torch.int32)):
        got = out.clone()
        kt.lora_add_(got, x, a, b, index, bounds)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
