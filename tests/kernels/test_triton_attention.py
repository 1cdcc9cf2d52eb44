"""The unified paged-attention kernel (prefill, chunked prefill, decode; GQA; sliding
window; split-KV decode) against the torch reference, through Triton's interpreter on
CPU or compiled on a GPU (tests/kernels/conftest.py decides)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.paged import PagedLayer
from tests.kernels.conftest import DEVICE, DTYPES, KT, TOL, needs_triton
from tests.kernels.paged import PagedStep, make_step, reference_attention

pytestmark = [needs_triton, pytest.mark.slow]


def _ragged(bs: int) -> list[tuple[int, int]]:
    """(cached context, new tokens): lengths from 1 to several blocks, in no order."""
    return [
        (0, 5),  # a fresh prompt inside one block
        (2 * bs + 2, 1),  # a decode three blocks deep
        (bs + 2, 9),  # a chunk after a cached prefix, crossing a block boundary
        (0, 1),  # a one-token prompt: sequence length 1
        (0, 2 * bs + 3),  # a fresh prompt over three blocks
        (bs - 1, 1),  # a decode that fills its first block exactly
    ]


def _attend(step: PagedStep, window: int | None = None, **kw: object) -> torch.Tensor:
    assert KT is not None
    KT.store_kv(step.k, step.v, step.k_cache, step.v_cache, step.slots)
    t = step.num_tokens
    decode = step.max_query_len == 1 and t == step.seq_lens.shape[0]
    batch = replace(step.batch, query_start_loc=None) if decode else step.batch
    layer = PagedLayer(step.k_cache, step.v_cache, step.q.shape[-1] ** -0.5, window)
    return KT.unified_attention(step.q[:t], layer, batch, **kw)


def _check(step: PagedStep, window: int | None = None, **kw: object) -> None:
    got = _attend(step, window, **kw)
    want = reference_attention(step, step.q.shape[-1] ** -0.5, window)
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= TOL[step.q.dtype] * 10, err


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
def test_ragged_batch_matches_reference(dtype, block_size, head_dim, gqa) -> None:  # type: ignore[no-untyped-def]
    kv_heads = 1 if gqa == 8 else 2
    step = make_step(
        _ragged(block_size),
        block_size=block_size,
        head_dim=head_dim,
        kv_heads=kv_heads,
        group=gqa,
        dtype=dtype,
        device=DEVICE,
        pad_tokens=3,  # slots -1: stored nowhere, attended by nobody
        seed=block_size + head_dim + gqa,
    )
    _check(step)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 3, 8])
def test_sliding_window(dtype, gqa) -> None:  # type: ignore[no-untyped-def]
    bs = 16
    step = make_step(
        [(3 * bs + 5, 1), (bs + 2, 11), (0, 2 * bs + 1), (2, 1)],
        block_size=bs, head_dim=64, kv_heads=2, group=gqa, dtype=dtype, device=DEVICE, seed=gqa,
    )  # fmt: skip
    for window in (1, bs + 3):  # one position; a window across a block boundary
        _check(step, window)
    if gqa == 1:
        _check(step, 10_000)  # wider than every sequence: the same as no window


@pytest.mark.parametrize("tile_n", [16, 64])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_tile_larger_or_smaller_than_a_block(tile_n, block_size) -> None:  # type: ignore[no-untyped-def]
    """A KV tile may span several pages (tile 64) or part of one (tile 16, block 32)."""
    step = make_step(
        _ragged(block_size),
        block_size=block_size, head_dim=64, kv_heads=2, group=3,
        dtype=torch.float32, device=DEVICE, seed=tile_n,
    )  # fmt: skip
    _check(step, None, tile_n=tile_n)
    _check(step, 7, tile_n=tile_n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("num_splits", [1, 2, 8])
def test_decode_batch_plain_and_split_kv(dtype, gqa, num_splits) -> None:  # type: ignore[no-untyped-def]
    """Decode-only batches: tile = sequence, or context split across programs and
    merged (including splits that get no tiles: 8 splits of a 1-token context)."""
    bs = 16
    step = make_step(
        [(0, 1), (5 * bs + 3, 1), (bs, 1), (9 * bs - 1, 1)],
        block_size=bs, head_dim=64, kv_heads=2, group=gqa, dtype=dtype, device=DEVICE,
        seed=num_splits,
    )  # fmt: skip
    for window in (None, 20):
        _check(step, window, num_splits=num_splits, tile_n=16)


def test_sequence_without_new_tokens_and_empty_batch() -> None:
    step = make_step(
        [(20, 0), (3, 4), (40, 0)],
        block_size=16, head_dim=64, kv_heads=2, group=2, dtype=torch.float32, device=DEVICE,
    )  # fmt: skip
    _check(step)
    empty = make_step(
        [], block_size=16, head_dim=64, kv_heads=2, group=2, dtype=torch.float32, device=DEVICE
    )
    assert _attend(empty).shape == (0, 4, 64)


def test_writes_into_a_given_output_and_leaves_padding_rows() -> None:
    assert KT is not None
    step = make_step(
        [(0, 3), (17, 1)],
        block_size=16, head_dim=64, kv_heads=2, group=2, dtype=torch.float32, device=DEVICE,
        pad_tokens=2,
    )  # fmt: skip
    out = torch.full(step.q.shape, 7.0, device=DEVICE)
    KT.store_kv(step.k, step.v, step.k_cache, step.v_cache, step.slots)
    layer = PagedLayer(step.k_cache, step.v_cache, 0.125)
    got = KT.unified_attention(step.q, layer, step.batch, out)
    assert got is out
    want = reference_attention(step, 0.125, None)
    assert (out[:4].cpu() - want).abs().max() < 1e-5
    assert bool((out[4:] == 7.0).all())  # tokens no sequence owns are not written


def test_bad_shapes_are_rejected() -> None:
    assert KT is not None
    step = make_step(
        [(0, 3)], block_size=16, head_dim=64, kv_heads=2, group=2,
        dtype=torch.float32, device=DEVICE,
    )  # fmt: skip
    layer, batch = PagedLayer(step.k_cache, step.v_cache, 0.1), step.batch
    with pytest.raises(ValueError, match="do not fit"):
        KT.unified_attention(step.q[:3, :3], layer, batch)
    with pytest.raises(TypeError, match=r"k_cache is torch\.float32, expected torch\.float16"):
        KT.unified_attention(step.q[:3].half(), layer, batch)
    with pytest.raises(ValueError, match="query_start_loc is required"):
        KT.unified_attention(step.q[:3], layer, replace(batch, query_start_loc=None))


@pytest.mark.gpu
def test_choose_num_splits_fills_the_gpu() -> None:
    assert KT is not None
    choose = KT.split_decode.choose_num_splits
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    assert choose(sms, 8, 32768, dev) == 1  # the batch alone fills the GPU
    assert choose(1, 8, 128, dev) == 1  # too short to split
    s = choose(1, 8, 32768, dev)
    assert 2 <= s <= KT.split_decode.MAX_SPLITS and s & (s - 1) == 0
