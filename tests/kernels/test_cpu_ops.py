"""The C++ CPU paged decode attention against a gather + SDPA reference."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ops, reference
from kernels.paged import PagedBatch, PagedLayer

# CI sets DIPTYCH_REQUIRE_CPU_OPS=1: there a failed build is a failure, not a skip.
if not cpu_ops.cpu_ops_available():
    if os.environ.get("DIPTYCH_REQUIRE_CPU_OPS") == "1":
        raise RuntimeError("the C++ CPU ops failed to build (see the warning above)")
    pytestmark = pytest.mark.skip(reason="no C++ toolchain to build the CPU ops")


def _reference(q, kc, vc, table, lens, scale, window):  # type: ignore[no-untyped-def]
    b, h, d = q.shape
    kvh, bs, nb = kc.shape[2], kc.shape[1], table.shape[1]
    k = kc[table.long()].reshape(b, nb * bs, kvh, d).transpose(1, 2).float()
    v = vc[table.long()].reshape(b, nb * bs, kvh, d).transpose(1, 2).float()
    j = torch.arange(nb * bs)[None]
    keep = j < lens.long()[:, None]
    if window:
        keep &= j > lens.long()[:, None] - 1 - window
    qg = q.view(b, kvh, h // kvh, d).float()
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=keep[:, None, None, :], scale=scale)
    return out.reshape(b, h, d)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_reference(dtype, block_size, head_dim, gqa, index_dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(hash((block_size, head_dim, gqa)) % 1000)
    kvh, batch, max_len, num_blocks = 2, 5, 3 * block_size + 5, 40
    # Pool layout as the engine has it: [blocks, layers, 2, block, kvh, d]; take layer 1.
    pool = torch.randn(num_blocks, 2, 2, block_size, kvh, head_dim, generator=g).to(dtype)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    nb = -(-max_len // block_size)
    table = torch.randint(1, num_blocks, (batch, nb), generator=g).to(index_dtype)
    lens = torch.tensor([1, block_size, block_size + 1, max_len, 7], dtype=index_dtype)
    q = torch.randn(batch, kvh * gqa, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    for window in (None, block_size // 2 + 3):
        layer = PagedLayer(kc, vc, scale, window)
        out = cpu_ops.paged_decode_attention(q, layer, PagedBatch(lens, table))
        ref = _reference(q, kc, vc, table, lens, scale, window)
        assert (out.float() - ref).abs().max() < TOL[dtype]


def test_index_dtypes_must_agree() -> None:
    kc = torch.zeros(4, 16, 1, 64)
    q = torch.zeros(1, 1, 64)
    table = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="share an index dtype"):
        cpu_ops.paged_decode_attention(
            q, PagedLayer(kc, kc, 1.0), PagedBatch(torch.ones(1, dtype=torch.int64), table)
        )
    with pytest.raises(RuntimeError, match="int32 or int64"):
        batch = PagedBatch(torch.ones(1, dtype=torch.int16), table.to(torch.int16))
        cpu_ops.paged_decode_attention(q, PagedLayer(kc, kc, 1.0), batch)


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g).to(dtype)
    res = torch.randn(7, 96, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    y, r = torch.ops.diptych_cpu.rms_norm(x, res, w, 1e-5)
    ry, rr = reference.rms_norm(x, res, w, 1e-5)
    assert torch.equal(r, rr)  # the residual sum rounds exactly as torch's add
    assert (y.float() - ry.float()).abs().max() <= _tol(dtype) * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rotary_in_place_on_a_strided_view(dtype) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 4 * 64 + 2 * 2 * 64, generator=g).to(dtype)
    q = qkv[:, : 4 * 64].view(5, 4, 64)  # the view the model rotates
    pos = torch.tensor([0, 3, 17, 100, 4095]).float()
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = (pos[:, None] * inv).cos(), (pos[:, None] * inv).sin()
    expected = q.clone()
    reference.rotary_(expected, cos, sin)
    torch.ops.diptych_cpu.rotary_(q, cos, sin)
    assert (q.float() - expected.float()).abs().max() <= _tol(dtype) * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(6, 2 * 80, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = torch.ops.diptych_cpu.silu_and_mul(x)
    assert (got.float() - reference.silu_and_mul(x).float()).abs().max() <= _tol(dtype) * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_skips_padding_slots(dtype) -> None:  # type: ignore[no-untyped-def]
    pool = torch.zeros(6, 2, 2, 16, 2, 64, dtype=dtype)  # [blocks, layers, kv, block, h, d]
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    k = torch.randn(4, 2, 64).to(dtype)
    v = torch.randn(4, 2, 64).to(dtype)
    slots = torch.tensor([17, -1, 40, 95])
    torch.ops.diptych_cpu.store_kv(k, v, kc, vc, slots)
    ref = torch.zeros_like(pool)
    reference.store_kv(k, v, ref[:, 1, 0], ref[:, 1, 1], slots)
    assert torch.equal(pool, ref)
    assert pool[:, 0].abs().sum() == 0  # the other layer is untouched
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.diptych_cpu.store_kv(k, v, kc, vc, torch.tensor([0, 1, 2, 6 * 16]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [96, 576, 208])
def test_small_m_linear(dtype, rows, k) -> None:  # type: ignore[no-untyped-def]
    # bf16 with K % 32 == 0 and up to 3 rows takes the AVX512-BF16 dot-product loop
    # where the CPU has it (96: tail chunks only; 576: full and tail); 208 does not.
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(rows, k + 32, generator=g).to(dtype)
    x = wide[:, 16 : 16 + k]  # rows not adjacent: the kernel must use x's row stride
    w = torch.randn(203, k, generator=g).to(dtype)
    b = torch.randn(203, generator=g).to(dtype)
    for bias in (None, b):
        got = cpu_ops.small_m_linear(x, w, bias)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else b.float())
        tol = 1e-4 if dtype == torch.float32 else 0.25 + 2**-8 * ref.abs().max().item()
        assert (got.float() - ref).abs().max() <= tol
        # fp32_out: the sums themselves, far closer than bf16 rounding allows
        wide32 = cpu_ops.small_m_linear(x, w, bias, fp32_out=True)
        assert wide32.dtype == torch.float32
        assert (wide32 - ref).abs().max() <= 1e-3 * (1 + ref.abs().max().item())
        assert torch.equal(wide32.to(dtype), got) or dtype == torch.float32
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        cpu_ops.small_m_linear(torch.zeros(9, 96), torch.zeros(4, 96), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torch_argmax(dtype) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(5, 1000 + 7, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[1, 3] = x[1, 900] = 50.0  # a tie: the first index wins
    x[2, -1] = 60.0  # the maximum in the tail past the last 16-lane chunk
    assert torch.equal(torch.ops.diptych_cpu.argmax_rows(x), x.argmax(dim=-1))


def _paged_case(batch: int, gqa: int, head_dim: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    kvh, bs, num_blocks = 3, 16, 64
    lens = torch.randint(1, 6 * bs, (batch,), generator=g, dtype=torch.int32)
    lens[0] = 6 * bs - 1  # an odd run of tokens in the last block
    table = torch.randperm(num_blocks - 1, generator=g)[: batch * 6].add(1)
    table = table.view(batch, 6).to(torch.int32)
    pool = torch.randn(num_blocks, 2, bs, kvh, head_dim, generator=g).bfloat16()
    q = torch.randn(batch, kvh * gqa, head_dim, generator=g).bfloat16()
    return q, pool[:, 0], pool[:, 1], table, lens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 2, 9])
@pytest.mark.parametrize("gqa,head_dim", [(1, 64), (3, 64), (7, 64), (4, 128), (3, 96), (9, 64)])
def test_attention_kernels_agree(monkeypatch, dtype, batch, gqa, head_dim) -> None:  # type: ignore[no-untyped-def]
    """Every decode-attention kernel this build has for the shape (the AVX512-BF16 one,
    the native-width fp32 one, the generic one) matches SDPA, and they agree with each
    other up to bf16 rounding of the probabilities."""
    q, kc, vc, table, lens = _paged_case(batch, gqa, head_dim, seed=batch * 100 + gqa)
    q, kc, vc = q.to(dtype), kc.to(dtype), vc.to(dtype)
    scale = head_dim**-0.5
    for window in (None, 21):
        ref = _reference(q, kc, vc, table, lens, scale, window)
        outs = {}
        for kernel in ("generic", "wide", "auto"):
            monkeypatch.setenv("DIPTYCH_ATTN_KERNEL", kernel)
            outs[kernel] = cpu_ops.paged_decode_attention(
                q, PagedLayer(kc, vc, scale, window), PagedBatch(lens, table)
            )
            assert (outs[kernel].float() - ref).abs().max() < TOL[dtype], kernel
        assert (outs["auto"].float() - outs["generic"].float()).abs().max() < TOL[dtype]


@pytest.mark.parametrize("batch", [1, 9])
def test_rows_outside_the_window_are_never_read(batch) -> None:  # type: ignore[no-untyped-def]
    """Slots past a sequence's length (and before its window) may hold anything, NaN
    included: freshly allocated blocks are not zeroed. None of it may leak out."""
    q, kc, vc, table, lens = _paged_case(batch, 3, 64, seed=7)
    window = 21
    clean_k, clean_v = kc.clone(), vc.clone()
    bs = kc.shape[1]
    for b in range(batch):
        n = int(lens[b])
        for pos in range(table.shape[1] * bs):
            if pos >= n or pos <= n - 1 - window:
                blk, t = int(table[b, pos // bs]), pos % bs
                kc[blk, t] = float("nan")
                vc[blk, t] = float("nan")
    layer = PagedLayer(kc, vc, 64**-0.5, window)
    out = cpu_ops.paged_decode_attention(q, layer, PagedBatch(lens, table))
    ref = _reference(q, clean_k, clean_v, table, lens, 64**-0.5, window)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max() < TOL[torch.bfloat16]
