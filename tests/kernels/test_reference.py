"""The torch references the Triton kernels are checked against, checked in turn
against plain fp64 loops, in every dtype (bf16 included: the interpreter cannot
check the kernels in bf16, so the references carry that dtype on CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels import reference
from kernels.paged import PagedBatch, PagedLayer
from tests.kernels.paged import make_step

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _naive_attention(q, kc, vc, qsl, lens, table, scale, window):  # type: ignore[no-untyped-def]
    """One query row, one head at a time, straight from the definition, in fp64."""
    t, h, d = q.shape
    bs, kvh = kc.shape[1], kc.shape[2]
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for s in range(len(lens)):
        n, a, b = int(lens[s]), int(qsl[s]), int(qsl[s + 1])
        for i in range(a, b):
            pos = n - (b - a) + (i - a)
            lo = 0 if not window else max(0, pos - window + 1)
            keys = range(lo, pos + 1)
            slots = [(int(table[s, j // bs]), j % bs) for j in keys]
            for head in range(h):
                g = head // (h // kvh)
                k = torch.stack([kc[blk, off, g] for blk, off in slots]).double()
                v = torch.stack([vc[blk, off, g] for blk, off in slots]).double()
                w = torch.softmax(k @ q[i, head].double() * scale, dim=0)
                out[i, head] = w @ v
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_unified_attention_reference(dtype, gqa, window) -> None:  # type: ignore[no-untyped-def]
    step = make_step(
        [(0, 4), (19, 1), (9, 8), (0, 1)],
        block_size=8, head_dim=16, kv_heads=2, group=gqa, dtype=dtype,
        device=torch.device("cpu"), index_dtype=torch.int32,
    )  # fmt: skip
    kc, vc = step.k_cache, step.v_cache
    reference.store_kv(step.k, step.v, kc, vc, step.slots)
    t = step.num_tokens
    got = reference.unified_attention(step.q[:t], PagedLayer(kc, vc, 0.25, window), step.batch)
    want = _naive_attention(
        step.q[:t], kc, vc, step.query_start_loc, step.seq_lens, step.block_table, 0.25, window
    )
    assert got.dtype == dtype
    assert (got.double() - want).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_references_agree(dtype) -> None:  # type: ignore[no-untyped-def]
    step = make_step(
        [(0, 1), (40, 1), (15, 1)], block_size=16, head_dim=32, kv_heads=2, group=4,
        dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    pool = step.pool.nan_to_num(0.0)  # the gather reference reads whole blocks
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    reference.store_kv(step.k, step.v, kc, vc, step.slots)
    for window in (None, 9):
        decode = PagedBatch(step.seq_lens, step.block_table)
        layer = PagedLayer(kc, vc, 0.2, window)
        a = reference.unified_attention(step.q, layer, decode)
        b = reference.paged_decode_attention(step.q, layer, decode)
        assert (a.float() - b.float()).abs().max() <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_copy_references(dtype) -> None:  # type: ignore[no-untyped-def]
    pool = torch.randn(6, 2, 2, 4, 1, 8).to(dtype)
    ids = torch.tensor([4, -1, 0], dtype=torch.int32)
    out = reference.gather_blocks(pool, ids, torch.zeros(3, *pool.shape[1:], dtype=dtype))
    assert torch.equal(out[0], pool[4]) and torch.equal(out[2], pool[0])
    assert not bool(out[1].any())
    other = pool.clone()
    reference.scatter_blocks(out, other, torch.tensor([5, 2, -1]))
    assert torch.equal(other[5], pool[4]) and torch.equal(other[2], out[1])
    assert torch.equal(other[[0, 1, 3, 4]], pool[[0, 1, 3, 4]])
    reference.copy_blocks(other, torch.tensor([1, -1]), torch.tensor([3, 4]))
    assert torch.equal(other[3], pool[1]) and torch.equal(other[4], pool[4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_layouts_are_the_same_rotation(dtype) -> None:  # type: ignore[no-untyped-def]
    """Interleaved pairs (2i, 2i+1) are half-split pairs (i, i + D/2) of a permuted head."""
    x = torch.randn(5, 3, 16).to(dtype)
    pos = torch.tensor([0.0, 1, 7, 300, 4000])
    f = pos[:, None] * (1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    cos, sin = f.cos(), f.sin()
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    inter = x.clone()
    reference.rotary_interleaved_(inter, cos, sin)
    half = x[..., perm].clone()
    reference.rotary_(half, cos, sin)
    assert torch.equal(inter[..., perm], half)
    # and it is a rotation: norms of each pair are kept (up to rounding)
    n0 = x.double().view(5, 3, 8, 2).norm(dim=-1)
    n1 = inter.double().view(5, 3, 8, 2).norm(dim=-1)
    assert (n0 - n1).abs().max() <= TOL[dtype] * 4 * math.sqrt(2) * float(n0.max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reference(dtype) -> None:  # type: ignore[no-untyped-def]
    x, r = torch.randn(4, 48).to(dtype), torch.randn(4, 48).to(dtype)
    w = (1 + 0.1 * torch.randn(48)).to(dtype)
    y, s = reference.rms_norm(x, r, w, 1e-6)
    h = (x + r).double()
    want = w.double() * h / (h.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    assert torch.equal(s, x + r)
    assert (y.double() - want).abs().max() <= TOL[dtype] * 8


def test_store_kv_reference_takes_int32_slots_and_skips_padding() -> None:
    kc, vc = torch.zeros(3, 4, 1, 2), torch.zeros(3, 4, 1, 2)
    k = torch.arange(6.0).view(3, 1, 2)
    reference.store_kv(k, -k, kc, vc, torch.tensor([5, -1, 0], dtype=torch.int32))
    assert torch.equal(kc[1, 1, 0], k[0, 0]) and torch.equal(vc[0, 0, 0], -k[2, 0])
    assert int((kc != 0).sum()) == 3  # k[0] = (0, 1): one nonzero; k[2] = (4, 5): two
