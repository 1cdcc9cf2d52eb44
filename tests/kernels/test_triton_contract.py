"""The index dtype contract: block tables, slot mappings, block ids, sequence lengths
and query start offsets work in int32 and in int64 (each independently, with
identical results), strided index views work, and every other dtype is rejected
with an error naming the argument."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from kernels.paged import PagedBatch, PagedLayer
from tests.kernels.conftest import DEVICE, KT, kernels_for, needs_triton
from tests.kernels.paged import PagedStep, make_step, reference_attention

pytestmark = needs_triton
WIDTHS = [torch.int32, torch.int64]
BAD = [torch.int16, torch.uint8, torch.float32, torch.bool]


def _step() -> PagedStep:
    return make_step(
        [(0, 3), (33, 1), (17, 6), (0, 1)],
        block_size=16, head_dim=64, kv_heads=2, group=3, dtype=torch.float32, device=DEVICE,
    )  # fmt: skip


def _run(step: PagedStep, table: torch.Tensor, lens: torch.Tensor, qsl: torch.Tensor,
         slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    assert KT is not None
    pool = step.pool.clone()
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    KT.store_kv(step.k, step.v, kc, vc, slots)
    batch = PagedBatch(lens, table, qsl, step.max_query_len, step.max_seq_len)
    return KT.unified_attention(step.q[: step.num_tokens], PagedLayer(kc, vc, 0.125), batch)


def test_attention_and_store_take_either_width_independently() -> None:
    step = _step()
    want = reference_attention(step, 0.125, None)
    results = []
    # every combination: a kernel specialized on each pointer type reads each right
    for t, n, q, s in itertools.product(WIDTHS, repeat=4):
        out = _run(
            step, step.block_table.to(t), step.seq_lens.to(n),
            step.query_start_loc.to(q), step.slots.to(s),
        )  # fmt: skip
        results.append(out)
    assert (results[0].cpu() - want).abs().max() < 1e-5
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_strided_index_views() -> None:
    """A column slice of a wider block table and every-other-element views."""
    step = _step()
    wide = torch.zeros(step.block_table.shape[0], 9, dtype=torch.int64, device=DEVICE)
    wide[:, 2 : 2 + step.block_table.shape[1]] = step.block_table
    table = wide[:, 2 : 2 + step.block_table.shape[1]]
    spaced = torch.zeros(2 * step.slots.shape[0], dtype=torch.int32, device=DEVICE)
    spaced[::2] = step.slots
    lens = torch.stack([step.seq_lens, step.seq_lens], 1)[:, 0]
    assert not table.is_contiguous() and not lens.is_contiguous()
    got = _run(step, table, lens, step.query_start_loc, spaced[::2])
    assert torch.equal(got, _run(step, step.block_table, step.seq_lens,
                                 step.query_start_loc, step.slots))  # fmt: skip


def _calls(step: PagedStep) -> dict[str, tuple[str, Callable[[torch.Tensor], object]]]:
    """kernel -> (argument name in its error, call with that index tensor replaced)."""
    assert KT is not None
    kc, vc = step.k_cache, step.v_cache
    t = step.num_tokens
    q = step.q[:t]

    def attn(**over: torch.Tensor) -> Callable[[torch.Tensor], object]:
        def call(bad: torch.Tensor) -> object:
            args = dict(query_start_loc=step.query_start_loc, seq_lens=step.seq_lens,
                        block_table=step.block_table)  # fmt: skip
            args[next(iter(over))] = bad
            batch = PagedBatch(
                args["seq_lens"], args["block_table"], args["query_start_loc"], 6, 34
            )
            return KT.unified_attention(q, PagedLayer(kc, vc, 0.1), batch)

        return call

    pool = step.pool
    ids = torch.tensor([1, 2], device=DEVICE)
    return {
        "block_table": ("block_table", attn(block_table=step.block_table)),
        "seq_lens": ("seq_lens", attn(seq_lens=step.seq_lens)),
        "query_start_loc": ("query_start_loc", attn(query_start_loc=step.query_start_loc)),
        "slot_mapping": (
            "slot_mapping",
            lambda bad: KT.store_kv(step.k[:t], step.v[:t], kc, vc, bad),
        ),
        "gather": ("block_ids", lambda bad: KT.gather_blocks(pool, bad)),
        "scatter": ("block_ids", lambda bad: KT.scatter_blocks(pool[:2], pool, bad)),
        "copy src": ("src_ids", lambda bad: KT.copy_blocks(pool, bad, ids)),
        "copy dst": ("dst_ids", lambda bad: KT.copy_blocks(pool, ids, bad)),
    }


@pytest.mark.parametrize("bad_dtype", BAD, ids=str)
def test_other_index_dtypes_are_rejected_by_name(bad_dtype) -> None:  # type: ignore[no-untyped-def]
    step = _step()
    originals = {
        "block_table": step.block_table,
        "seq_lens": step.seq_lens,
        "query_start_loc": step.query_start_loc,
        "slot_mapping": step.slots[: step.num_tokens],
    }
    for kernel, (arg, call) in _calls(step).items():
        like = originals.get(kernel, torch.tensor([1, 2]))
        with pytest.raises(TypeError, match=f"{arg} must be int32 or int64, got {bad_dtype}"):
            call(like.to(bad_dtype).to(DEVICE))


def test_index_tensors_must_be_on_the_data_device() -> None:
    step = _step()
    for kernel, (arg, call) in _calls(step).items():
        with pytest.raises(ValueError, match=f"{arg} is on meta"):
            call(torch.empty(2, dtype=torch.int64, device="meta"))
        assert kernel


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("width", WIDTHS, ids=str)
def test_every_backend_takes_both_widths(backend, width) -> None:  # type: ignore[no-untyped-def]
    """Through `kernels.ops.Kernels` (C++ ops on CPU, references, Triton): the same results for
    int32 and int64 index tensors, or, on the C++ decode path, a clear error if the
    table and the lengths disagree in width."""
    step = _step()
    kernels = kernels_for(backend)
    # the gather + SDPA reference needs finite stale slots (the engine zeroes its
    # pool); the kernels do not, which the other tests show with NaN-filled pools
    pool = step.pool.nan_to_num(0.0)
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    t = step.num_tokens
    kernels.store_kv(step.k[:t], step.v[:t], kc, vc, step.slots[:t].to(width))
    batch = PagedBatch(
        step.seq_lens.to(width), step.block_table.to(width), step.query_start_loc.to(width),
        max_query_len=6, max_seq_len=34,
    )  # fmt: skip
    layer = PagedLayer(kc, vc, 0.125)
    out = kernels.unified_attention(step.q[:t], layer, batch)
    assert (out.cpu() - reference_attention(step, 0.125, None)).abs().max() < 1e-5
    rows = step.query_start_loc[1:].long() - 1  # each sequence's last token
    decode = PagedBatch(batch.seq_lens, batch.block_table, max_seq_len=34)
    dec = kernels.unified_attention(step.q[rows], layer, decode)
    assert (dec.cpu() - out[rows].cpu()).abs().max() < 1e-5


@pytest.mark.gpu
def test_pools_past_2_31_elements_address_correctly() -> None:
    """The last block of a pool with more than 2**31 elements (4.3 GB in fp16) sits past
    what int32 offsets reach: int32 slots and tables must still land there."""
    assert KT is not None
    bs, kvh, d = 16, 8, 128
    per_block = 2 * 2 * bs * kvh * d  # 2 layers x K/V
    num_blocks = 2**31 // per_block + 2
    if torch.cuda.mem_get_info()[0] < num_blocks * per_block * 2 * 1.3:
        pytest.skip("not enough free GPU memory for a 4.3 GB pool")
    pool = torch.zeros(num_blocks, 2, 2, bs, kvh, d, dtype=torch.float16, device="cuda")
    last = num_blocks - 1
    kc, vc = pool[:, 1, 0], pool[:, 1, 1]
    k = torch.randn(5, kvh, d, device="cuda").half()
    slots = torch.arange(5, dtype=torch.int32, device="cuda") + last * bs
    KT.store_kv(k, -k, kc, vc, slots)
    assert torch.equal(kc[last, :5], k) and torch.equal(vc[last, :5], -k)
    table = torch.tensor([[last]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([5], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 2 * kvh, d, device="cuda").half()
    batch = PagedBatch(lens, table, max_seq_len=5)
    got = KT.unified_attention(q, PagedLayer(kc, vc, 0.1), batch, num_splits=1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float().view(1, kvh, 2, d), k.float().transpose(0, 1)[None],
        -k.float().transpose(0, 1)[None], scale=0.1,
    ).view(1, 2 * kvh, d)  # fmt: skip
    assert (got.float() - want).abs().max() < 2e-3
    staging = KT.gather_blocks(pool, torch.tensor([last], dtype=torch.int32, device="cuda"))
    assert torch.equal(staging[0], pool[last])
