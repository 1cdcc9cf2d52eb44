"""`kernels.ops.row_invariant`: inside it, each row of a linear of up to 8 rows comes
out bit for bit as that row alone would, whatever weight path the model uses (a
packed bf16 copy for oneDNN / our GEMMs, a plain fp32 weight, quantized weights, the
head's fp32 sums). Speculative verify steps rely on it (engine/model_runner.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, ops
from kernels.quant import QuantTensor, quantize_int4, quantize_int8
from tests.kernels.test_kv_quant import needs_cpu_ops

pytestmark = needs_cpu_ops

ROWS = cpu_ops.SMALL_M_MAX


def _rows_alone(run: object, x: torch.Tensor) -> torch.Tensor:
    assert callable(run)
    return torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])])


def _check(run: object, x: torch.Tensor) -> None:
    assert callable(run)
    with ops.row_invariant(ROWS):
        alone = _rows_alone(run, x)
        for m in range(2, ROWS + 1):
            assert torch.equal(run(x[:m]), alone[:m]), m


@pytest.mark.parametrize("fp32_out", [False, True])
def test_bf16_with_a_packed_copy(fp32_out: bool) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(192, 576, generator=g).to(torch.bfloat16)
    x = torch.randn(ROWS, 576, generator=g).to(torch.bfloat16)
    packed = cpu_ops.pack_linear_weight(w, fp32_sums=fp32_out)
    weight = w if not packed.serves_all_rows else w.new_empty(0)  # as the model keeps it
    _check(lambda r: ops.linear(r, weight, None, packed, fp32_out), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_plain_weight(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(160, 256, generator=g).to(dtype)
    b = torch.randn(160, generator=g).to(dtype)
    x = torch.randn(ROWS, 256, generator=g).to(dtype)
    _check(lambda r: ops.linear(r, w, b), x)


@pytest.mark.parametrize("quantize", [quantize_int8, quantize_int4])
def test_quantized_weights(quantize: object) -> None:
    assert callable(quantize)
    g = torch.Generator().manual_seed(2)
    q: QuantTensor = quantize(torch.randn(128, 256, generator=g))
    x = torch.randn(ROWS, 256, generator=g)
    _check(lambda r: ops.quant_linear(r, q, None, True), x)


def test_it_is_scoped_and_capped() -> None:
    assert ops.row_invariant_rows() == 0
    with ops.row_invariant(100):
        assert ops.row_invariant_rows() == ROWS
        with ops.row_invariant(0):
            assert ops.row_invariant_rows() == 0
        assert ops.row_invariant_rows() == ROWS
    assert ops.row_invariant_rows() == 0
