"""GGUF blocks re-laid out once, exactly, into `kernels.quant.QuantTensor` planes.

See `kernels/quant.py` for the layouts; `from_gguf` maps every type of `KEPT_TYPES`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.weights.dequant import _f16, _k_quants_4, _k_scales_mins, _nibbles, _q5_0, _q6_k
from kernels.quant import QuantTensor, pack_q4, pack_q8

Bytes = npt.NDArray[np.uint8]
_Q = GGMLQuantizationType
# GGUF types kept quantized, and the layout each becomes.
# Q5_0 keeps its 5-bit values exactly as int8 codes (1 byte a value, not 5/8: still
# half of bf16); llama.cpp's Q4_K mixes fall back to it where a row is not 256 wide.
KEPT_TYPES = {
    _Q.Q4_0: "q4", _Q.Q4_1: "q4", _Q.Q4_K: "q4", _Q.Q8_0: "q8", _Q.Q6_K: "q8", _Q.Q5_0: "q8",
}  # fmt: skip


def _q4(codes: Bytes, scales: npt.NDArray[np.generic], mins: npt.NDArray[np.generic],
        source: str, k: int) -> QuantTensor:  # fmt: skip
    t = torch.from_numpy
    return pack_q4(t(np.ascontiguousarray(codes)), t(np.ascontiguousarray(scales)),
                   t(np.ascontiguousarray(mins)), source, k)  # fmt: skip


def _q8(codes: npt.NDArray[np.int8], scales: npt.NDArray[np.generic], group: int,
        source: str, k: int) -> QuantTensor:  # fmt: skip
    t = torch.from_numpy
    return pack_q8(t(np.ascontiguousarray(codes)), t(np.ascontiguousarray(scales)), group,
                   source, k)  # fmt: skip


def from_gguf(
    raw: npt.NDArray[np.generic], qtype: int, row_order: torch.Tensor | None = None
) -> QuantTensor:
    """A 2-D GGUF tensor of a `KEPT_TYPES` type (as `GGUFReader` exposes it: uint8
    [N, row_bytes]) in our layout, its rows taken in `row_order` if given."""
    qtype = GGMLQuantizationType(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = np.ascontiguousarray(raw).view(np.uint8)
    if row_order is not None:
        data = data[row_order.numpy()]
    if data.ndim != 2 or data.shape[1] % type_size:
        raise ValueError(f"{qtype.name} tensor of shape {raw.shape} is not [rows, blocks]")
    n = data.shape[0]
    nb = data.shape[1] // type_size
    k = nb * block_size
    blocks = data.reshape(n * nb, type_size)

    def f16(start: int) -> npt.NDArray[np.float16]:
        return blocks[:, start : start + 2].view(np.float16).reshape(n, -1)

    if qtype == _Q.Q4_0:
        d = f16(0)
        return _q4(_nibbles(blocks[:, 2:]).reshape(n, nb, 32), d, d * np.float16(-8), "Q4_0", k)
    if qtype == _Q.Q4_1:
        return _q4(_nibbles(blocks[:, 4:]).reshape(n, nb, 32), f16(0), f16(2), "Q4_1", k)
    if qtype == _Q.Q4_K:
        sc, mn = _k_scales_mins(blocks[:, 4:16])  # [n*nb, 8] each
        d, dmin = f16(0).astype(np.float32), f16(2).astype(np.float32)
        scales = (d.reshape(-1, 1) * sc).reshape(n, nb * 8)
        mins = -(dmin.reshape(-1, 1) * mn).reshape(n, nb * 8)
        codes = _k_quants_4(blocks[:, 16:]).reshape(n, nb * 8, 32)
        return _q4(codes, scales, mins, "Q4_K", k)
    if qtype == _Q.Q8_0:
        return _q8(blocks[:, 2:].view(np.int8).reshape(n, k), f16(0), 32, "Q8_0", k)
    if qtype == _Q.Q5_0:  # codes q - 16
        values = _unit_codes(blocks, _q5_0, d_at=0).reshape(n, k)
        return _q8(values, f16(0), 32, "Q5_0", k)
    if qtype == _Q.Q6_K:  # codes q - 32
        values = _unit_codes(blocks, _q6_k, d_at=208, int8_scales=slice(192, 208))
        scales = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return _q8(values.reshape(n, k), scales.reshape(n, nb * 16), 16, "Q6_K", k)
    raise ValueError(f"GGUF type {qtype.name} is not kept quantized")


_ONE_F16 = np.frombuffer(np.float16(1).tobytes(), np.uint8)


def _unit_codes(
    blocks: Bytes, decode: Callable[[Bytes], npt.NDArray[np.float32]], d_at: int,
    int8_scales: slice | None = None,
) -> npt.NDArray[np.int8]:  # fmt: skip
    """A block type's integer codes: its decoder run with d (the fp16 at `d_at`) and any
    int8 sub-block scales set to 1, which is exact in fp32."""
    unit = blocks.copy()
    unit[:, d_at : d_at + 2] = _ONE_F16
    if int8_scales is not None:
        unit[:, int8_scales] = 1
    return decode(unit).astype(np.int8)
