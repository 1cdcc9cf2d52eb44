"""The Triton quantized linear (`kernels/triton/quant_linear.py`) on every weight layout
we keep (q4 with fp16 and fp32 scales, q8 in groups of 32 and 16, int8 per channel,
int4), against the torch reference: x @ the weight dequantized to x's dtype. Run by
the interpreter on CPU (fp32, fp16), compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import QuantTensor
from tests.kernels.conftest import DEVICE, DTYPES, KT, TOL, kernels_for, needs_triton
from tests.kernels.test_quant_linear import _weights

pytestmark = needs_triton


def _on_device(w: QuantTensor) -> QuantTensor:
    return w.to(DEVICE)


@pytest.mark.parametrize("w", _weights(), ids=lambda w: w.source)
@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_dequantized_product(w: QuantTensor, rows: int, dtype: torch.dtype) -> None:
    assert KT is not None
    w = _on_device(w)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, w.shape[1], generator=gen).to(dtype).to(DEVICE)
    ref = x.float() @ w.dequantize(dtype).float().T
    y = KT.quant_linear(x, w, None, fp32_out=True)
    assert y.dtype == torch.float32 and y.shape == (rows, w.shape[0])
    scale = ref.abs().max().item() + 1
    assert (y - ref).abs().max().item() <= TOL[dtype] * scale * 4
    bias = torch.randn(w.shape[0], generator=gen).to(dtype).to(DEVICE)
    yb = KT.quant_linear(x, w, bias)
    assert yb.dtype == dtype
    assert (yb.float() - (ref + bias.float())).abs().max().item() <= TOL[dtype] * scale * 8


def test_the_engine_op_runs_it_and_refuses_bad_input() -> None:
    assert KT is not None
    w = _on_device(_weights()[0])
    x = torch.randn(3, w.shape[1]).to(DEVICE)
    ops_t = kernels_for("triton")
    got = ops_t.quant_linear(x[None], w)  # [1, 3, K]: the op flattens leading dims
    assert got.shape == (1, 3, w.shape[0])
    assert torch.allclose(got[0], KT.quant_linear(x, w))
    assert KT.quant_linear(x[:0], w).shape == (0, w.shape[0])
    with pytest.raises(ValueError, match="must be"):
        KT.quant_linear(x[:, :-1], w)
    with pytest.raises(TypeError):
        KT.quant_linear(x.to(torch.int32), w)
