"""bf16 on CPU: linears above three rows read a oneDNN-blocked copy of the weight."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.layers import Linear
from kernels import cpu_ops

if not cpu_ops.weight_prepack_available(torch.bfloat16):
    pytest.skip("this torch has no oneDNN bf16 linear", allow_module_level=True)


@pytest.mark.parametrize("rows", [4, 64, 300])
def test_packed_linear_is_the_plain_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g).bfloat16()
    bias = torch.randn(960, generator=g).bfloat16()
    wide = torch.randn(rows, 700, generator=g).bfloat16()
    x = wide[:, 50:626]  # a strided view, as slices of a fused projection are
    packed = cpu_ops.pack_linear_weight(w)
    for b in (None, bias):
        got = cpu_ops.packed_linear(x, packed, b)
        want = torch.nn.functional.linear(x, w, b)
        assert got.shape == want.shape
        assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()


def _decode(llm: LLM) -> list[list[int]]:
    prompts = [[1 + (7 * i + 3 * j) % 4000 for j in range(5 + 3 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_engine_prepacks_and_decodes_the_same(make_llm: Callable[..., LLM]) -> None:
    on = make_llm(dtype="bfloat16")
    off = make_llm(dtype="bfloat16", cpu_weight_prepack=False)
    on_model, off_model = on.engine.runner.model, off.engine.runner.model
    linears = [m for m in on_model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    assert on_model.packed_head is not None  # SmolLM2 ties its head to the embedding
    assert all(m.packed is None for m in off_model.modules() if isinstance(m, Linear))
    # eight sequences decode together: every linear takes the packed path
    assert _decode(on) == _decode(off)
