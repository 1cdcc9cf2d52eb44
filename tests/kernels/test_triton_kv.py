"""KV store and whole-block gather/scatter/copy kernels against the torch references.
Both move bits, so they are exact in every dtype, bf16 included, even in the
interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.conftest import DEVICE, KT, needs_triton
from tests.kernels.paged import make_step

pytestmark = needs_triton
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_store_kv_matches_reference(dtype, block_size, head_dim, kv_heads) -> None:  # type: ignore[no-untyped-def]
    assert KT is not None
    step = make_step(
        [(3, 5), (block_size - 1, 2), (0, 2 * block_size + 1)],
        block_size=block_size, head_dim=head_dim, kv_heads=kv_heads, group=1,
        dtype=dtype, device=DEVICE, pad_tokens=4,
    )  # fmt: skip
    want = step.pool.clone()
    reference.store_kv(step.k, step.v, want[:, 1, 0], want[:, 1, 1], step.slots)
    KT.store_kv(step.k, step.v, step.k_cache, step.v_cache, step.slots)
    # NaN == NaN here: compare bits; layer 0 and every slot not named stay untouched
    assert torch.equal(step.pool.view(torch.uint8), want.view(torch.uint8))


def test_store_kv_all_padding_and_empty() -> None:
    assert KT is not None
    pool = torch.zeros(4, 1, 2, 16, 2, 64, device=DEVICE)
    k = torch.randn(3, 2, 64, device=DEVICE)
    KT.store_kv(k, k, pool[:, 0, 0], pool[:, 0, 1], torch.full((3,), -1, device=DEVICE))
    assert not bool(pool.any())
    KT.store_kv(k[:0], k[:0], pool[:, 0, 0], pool[:, 0, 1], torch.zeros(0, device=DEVICE).long())


def test_store_kv_rejects_mismatches() -> None:
    assert KT is not None
    pool = torch.zeros(4, 1, 2, 16, 2, 64, device=DEVICE)
    k = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="one dtype"):
        KT.store_kv(k.half(), k.half(), pool[:, 0, 0], pool[:, 0, 1], slots)
    with pytest.raises(ValueError, match="do not take rows"):
        KT.store_kv(k[:, :1], k[:, :1], pool[:, 0, 0], pool[:, 0, 1], slots)
    with pytest.raises(ValueError, match="3 tokens"):
        KT.store_kv(k, k, pool[:, 0, 0], pool[:, 0, 1], slots[:2])


def _pool(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # [blocks, layers, K/V, block_size, kv_heads, head_dim]
    return torch.randn(10, 3, 2, 16, 2, 64, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_scatter_round_trip(dtype, index_dtype) -> None:  # type: ignore[no-untyped-def]
    assert KT is not None
    pool = _pool(dtype)
    ids = torch.tensor([7, 2, -1, 9, 2], dtype=index_dtype, device=DEVICE)
    staging = torch.full((5, *pool.shape[1:]), 3.0, dtype=dtype, device=DEVICE)
    want = reference.gather_blocks(pool, ids, staging.clone())
    got = KT.gather_blocks(pool, ids, staging)
    assert got is staging and torch.equal(got, want)
    assert bool((got[2] == 3.0).all())  # a -1 id leaves its staging row alone
    assert torch.equal(got[0], pool[7]) and torch.equal(got[1], pool[2])

    other = _pool(dtype, seed=1)
    dst = torch.tensor([4, -1, 1, 0, 8], dtype=index_dtype, device=DEVICE)
    want_pool = other.clone()
    reference.scatter_blocks(got, want_pool, dst)
    KT.scatter_blocks(got, other, dst)
    assert torch.equal(other, want_pool)
    assert torch.equal(other[4], pool[7]) and torch.equal(other[8], pool[2])


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_copy_blocks_for_copy_on_write(dtype) -> None:  # type: ignore[no-untyped-def]
    assert KT is not None
    pool = _pool(dtype)
    want = pool.clone()
    src = torch.tensor([1, 5, -1, 3], device=DEVICE)
    dst = torch.tensor([6, 7, 8, -1], dtype=torch.int32, device=DEVICE)
    reference.copy_blocks(want, src, dst)
    KT.copy_blocks(pool, src, dst)
    assert torch.equal(pool, want)
    assert torch.equal(pool[6], pool[1]) and torch.equal(pool[7], pool[5])


def test_blocks_of_a_layer_view_and_odd_sizes() -> None:
    """A layer's view (blocks contiguous, strided apart) and blocks whose byte size is
    not a multiple of 4 (copied as 16-bit words)."""
    assert KT is not None
    pool = _pool(torch.float16)
    layer = pool[:, 1]
    ids = torch.tensor([3, 0, 9], device=DEVICE)
    assert torch.equal(KT.gather_blocks(layer, ids), layer[ids])
    odd = torch.randn(6, 3, 5, device=DEVICE).half()  # 15 halves = 30 bytes per block
    staging = KT.gather_blocks(odd, torch.tensor([5, 1], device=DEVICE))
    assert torch.equal(staging, odd[[5, 1]])
    KT.scatter_blocks(staging, odd, torch.tensor([0, 2], device=DEVICE))
    assert torch.equal(odd[0], odd[5]) and torch.equal(odd[2], odd[1])


def test_block_copies_reject_mismatches() -> None:
    assert KT is not None
    pool = _pool(torch.float32)
    ids = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="does not hold blocks"):
        KT.gather_blocks(pool, ids, torch.empty(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="holds 1 blocks, 2 requested"):
        KT.scatter_blocks(pool[:1], pool, ids)
    with pytest.raises(ValueError, match="differ"):
        KT.copy_blocks(pool, ids, ids[:1])
    with pytest.raises(ValueError, match="contiguous"):
        KT.gather_blocks(pool.transpose(1, 2), ids)
    assert KT.gather_blocks(pool, ids[:0]).shape == (0, *pool.shape[1:])
