"""Prompts as rows of the batch-invariant attention in the default mode
(`TorchAttention.prompt_rows`, engine/attention/backend.py): a mixed step (decodes, a
verification chunk, whole prompts, chunks after a cached prefix, a sliding window)
attends as the SDPA path does, within the dtype's rounding; the decode rows are the
same bits; a tail after a cached prefix is its whole prompt's rows bit for bit; and the
runner turns the rows on exactly where `cpu_ops.det_attention_for_prompts` says they
are faster."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig
from engine.attention import BatchLayout, TorchAttention
from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from kernels import cpu_isa, cpu_ops

pytestmark = pytest.mark.skipif(
    not cpu_ops.cpu_ops_available(), reason="the C++ CPU ops did not build"
)

H, KVH, D, BS = 6, 2, 64, 16
CPU = torch.device("cpu")


def _step(
    backend: TorchAttention, seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, BatchLayout]:
    """Attend one step of (computed tokens, new tokens) sequences, each on blocks of its
    own, over a cache whose computed part is random; the output [T, H * D]."""
    g = torch.Generator().manual_seed(seed)
    ids, nxt = [], 1
    for computed, new in seqs:
        n = -(-(computed + new) // BS)
        ids.append(list(range(nxt, nxt + n)))
        nxt += n
    cache = torch.randn(nxt, 2, BS, KVH, D, generator=g).to(dtype)
    layout = BatchLayout.build([n for _, n in seqs], [c for c, _ in seqs], ids, BS, CPU)
    t = layout.num_tokens
    q = torch.randn(t, H, D, generator=g).to(dtype)
    k = torch.randn(t, KVH, D, generator=g).to(dtype)
    v = torch.randn(t, KVH, D, generator=g).to(dtype)
    return backend.forward(q, k, v, cache, backend.prepare(layout)), layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 21])
def test_a_mixed_step_attends_as_sdpa_does(dtype: torch.dtype, window: int | None) -> None:
    # two decodes, a verification (3 rows over a context), a whole prompt, a chunk
    # after a cached prefix, a one-token prompt
    seqs = [(40, 1), (7, 1), (30, 3), (0, 37), (45, 20), (0, 1)]
    sdpa = TorchAttention(H, KVH, D, D**-0.5, window)
    rows = TorchAttention(H, KVH, D, D**-0.5, window)
    rows.prompt_rows = True
    want, layout = _step(sdpa, seqs, dtype)
    got, _ = _step(rows, seqs, dtype)
    nd = layout.num_decodes + 3  # the decode kernel's rows: the decodes, the verification
    assert torch.equal(got[:nd], want[:nd])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_cached_tail_is_its_whole_prompts_rows() -> None:
    backend = TorchAttention(H, KVH, D, D**-0.5)
    backend.prompt_rows = True
    meta = backend.prepare(BatchLayout.build([50], [0], [[1, 2, 3, 4]], BS, CPU))
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 2, BS, KVH, D, generator=g).bfloat16()
    q = torch.randn(50, H, D, generator=g).bfloat16()
    kv = torch.randn(2, 50, KVH, D, generator=g).bfloat16()
    whole = backend.forward(q, kv[0], kv[1], cache, meta)
    # the same prompt's last 18 tokens after its first 32 came from the prefix cache
    tail = BatchLayout.build([1, 18], [9, 32], [[5], [1, 2, 3, 4]], BS, CPU)
    other = torch.randn(1, H, D, generator=g).bfloat16()
    k, v = (torch.cat([kv[i, :1], kv[i, 32:]]) for i in (0, 1))
    out = backend.forward(torch.cat([other, q[32:]]), k, v, cache, backend.prepare(tail))
    assert torch.equal(out[1:], whole[32:])


def test_the_runner_uses_the_rows_where_they_are_faster() -> None:
    bf16_dot = cpu_isa.probe().at_least("avx512_bf16")
    assert cpu_ops.det_attention_for_prompts(torch.bfloat16, torch.bfloat16, 64) == bf16_dot
    assert not cpu_ops.det_attention_for_prompts(torch.float32, torch.float32, 64)
    assert not cpu_ops.det_attention_for_prompts(torch.bfloat16, torch.int8, 64)
    assert not cpu_ops.det_attention_for_prompts(torch.bfloat16, torch.bfloat16, 72)
    for dtype, kv, on in (("bfloat16", "auto", bf16_dot), ("float32", "auto", False),
                          ("bfloat16", "int8", False)):  # fmt: skip
        core = EngineCore(EngineConfig(dtype=dtype, kv_cache_dtype=kv, num_blocks=32))
        assert isinstance(core.runner, ModelRunner)
        backend = core.runner.attn_backend
        assert isinstance(backend, TorchAttention)
        assert backend.prompt_rows == on
