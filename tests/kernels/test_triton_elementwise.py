"""Fused RMSNorm (+ residual), rotary (half-split and interleaved) and silu-and-mul
kernels against the torch references."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.conftest import DEVICE, DTYPES, KT, TOL, needs_triton

pytestmark = needs_triton


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual) -> None:  # type: ignore[no-untyped-def]
    assert KT is not None
    # rows of a wider buffer: a row stride that is not the hidden size
    x = _randn(5, hidden + 32, dtype=dtype, seed=hidden)[:, :hidden]
    res = _randn(5, hidden, dtype=dtype, seed=1) if with_residual else None
    w = (1 + 0.1 * _randn(hidden, dtype=torch.float32, seed=2)).to(dtype)
    y, r = KT.rms_norm(x, res, w, 1e-6)
    ry, rr = reference.rms_norm(x.cpu(), None if res is None else res.cpu(), w.cpu(), 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(r.cpu(), rr)  # the residual sum rounds exactly as torch's add
    assert (y.float().cpu() - ry.float()).abs().max() <= TOL[dtype] * 4


def test_rms_norm_empty_and_unsupported() -> None:
    assert KT is not None
    w = torch.ones(64, device=DEVICE)
    y, _ = KT.rms_norm(torch.zeros(0, 64, device=DEVICE), None, w, 1e-6)
    assert y.shape == (0, 64)
    assert not KT.rms_norm_supports(torch.zeros(2, 3, 64), None, w)  # 3-D: the reference's
    assert not KT.rms_norm_supports(torch.zeros(2, 64), None, w.half())  # mixed dtypes


def _cos_sin(positions: list[int], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.tensor(positions).float()
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    f = pos[:, None] * inv[None, :]
    return f.cos().to(DEVICE), f.sin().to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_in_place_on_strided_q_and_k(dtype, head_dim, interleaved) -> None:  # type: ignore[no-untyped-def]
    assert KT is not None
    heads, kv_heads, t = 6, 2, 5
    qkv = _randn(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=head_dim)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    cos, sin = _cos_sin([0, 3, 17, 100, 4095], head_dim)
    rotate = reference.rotary_interleaved_ if interleaved else reference.rotary_
    want_q, want_k = q.clone().cpu(), k.clone().cpu()
    rotate(want_q, cos.cpu(), sin.cpu())
    rotate(want_k, cos.cpu(), sin.cpu())
    KT.rotary_(q, cos, sin, interleaved)
    KT.rotary_(k, cos, sin, interleaved)
    # the reference rounds each product to the dtype; the kernel rounds once: 1 ulp
    for got, want in ((q, want_q), (k, want_k)):
        assert (got.float().cpu() - want.float()).abs().max() <= TOL[dtype] * 4
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # V untouched


def test_rotary_rejects_bad_tables() -> None:
    assert KT is not None
    x = torch.zeros(3, 2, 64, device=DEVICE)
    cos, sin = _cos_sin([0, 1, 2], 64)
    with pytest.raises(ValueError, match=r"cos must be \[3, 32\]"):
        KT.rotary_(x, cos[:2], sin)
    with pytest.raises(TypeError, match=r"cos is torch\.float16"):
        KT.rotary_(x, cos.half(), sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [80, 1100])
def test_silu_and_mul(dtype, inter) -> None:  # type: ignore[no-untyped-def]
    assert KT is not None
    x = _randn(4, 2 * inter, dtype=dtype, seed=inter)
    got = KT.silu_and_mul(x)
    want = reference.silu_and_mul(x.cpu())
    assert (got.float().cpu() - want.float()).abs().max() <= TOL[dtype] * 4
