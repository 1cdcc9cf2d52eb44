"""Dequantizers for the GGUF tensor types we load, written in vectorised numpy.

Every GGUF tensor is a sequence of fixed-size blocks. A block of `block_size`
weights occupies `type_size` bytes; each row of a tensor is a whole number of
blocks, so dequantizing is: view the bytes as `[n_blocks, type_size]`, decode all
blocks at once into `[n_blocks, block_size]` float32, reshape to the rows.

Layouts (little-endian; `d`, `m`, `dmin` are float16; "nibbles" means the low
nibbles of the quant bytes hold the first half of the block and the high
nibbles the second half):

    Q8_0  d | int8 q[32]                          x = d * q
    Q4_0  d | nibbles[16]                         x = d * (q - 8)
    Q4_1  d | m | nibbles[16]                     x = d * q + m
    Q5_0  d | u32 high bits | nibbles[16]         x = d * (q - 16)
    Q5_1  d | m | u32 high bits | nibbles[16]     x = d * q + m
          (bit i of the u32 is bit 4 of quant i)
    Q4_K  super-block of 256 = 8 sub-blocks of 32, each with a 6-bit scale and a 6-bit
          min packed into 12 bytes:  d | dmin | scales[12] | q[128]
          x = d * scale[j] * q - dmin * min[j]
    Q5_K  as Q4_K plus qh[32] holding bit 4 of every quant:  d | dmin | scales[12] | qh | q
    Q6_K  16 sub-blocks of 16 with int8 scales:  ql[128] | qh[64] | scales[16] | d
          x = d * scale[j] * (q - 32)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.config import UnsupportedModelError

Bytes = npt.NDArray[np.uint8]
Floats = npt.NDArray[np.float32]


def _f16(blocks: Bytes, start: int) -> Floats:
    """The float16 at byte `start` of every block, as a float32 column [n, 1]."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: Bytes) -> Bytes:
    """[n, k] packed bytes -> [n, 2k] values: all low nibbles, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _low_bits_5(blocks: Bytes, start: int) -> Bytes:
    """Bit 4 of each of the 32 quants of a Q5_0/Q5_1 block, already shifted into place."""
    qh = blocks[:, start : start + 4].view("<u4")  # [n, 1]
    bits = (qh >> np.arange(32, dtype=np.uint32)) & 1
    return (bits << 4).astype(np.uint8)


def _f32(blocks: Bytes) -> Floats:
    return blocks.view("<f4").copy()


def _f16_type(blocks: Bytes) -> Floats:
    return blocks.view("<f2").astype(np.float32)


def _bf16(blocks: Bytes) -> Floats:
    # bf16 is the high half of a float32.
    return (blocks.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _q8_0(blocks: Bytes) -> Floats:
    x = blocks[:, 2:].view(np.int8).astype(np.float32)
    x *= _f16(blocks, 0)
    return x


def _q4_0(blocks: Bytes) -> Floats:
    q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
    return _f16(blocks, 0) * q.astype(np.float32)


def _q4_1(blocks: Bytes) -> Floats:
    q = _nibbles(blocks[:, 4:]).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _q5_0(blocks: Bytes) -> Floats:
    q = (_nibbles(blocks[:, 6:]) | _low_bits_5(blocks, 2)).astype(np.int8) - np.int8(16)
    return _f16(blocks, 0) * q.astype(np.float32)


def _q5_1(blocks: Bytes) -> Floats:
    q = (_nibbles(blocks[:, 8:]) | _low_bits_5(blocks, 4)).astype(np.float32)
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _k_scales_mins(packed: Bytes) -> tuple[Floats, Floats]:
    """Unpack the 12-byte scale field of Q4_K/Q5_K into 8 scales and 8 mins (6 bits each).

    Bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; bytes
    8-11 hold the low 4 bits of scale (low nibble) and min (high nibble) 4-7,
    whose top 2 bits are the spare top bits of bytes 0-3 (scales) and 4-7 (mins).
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_quants_4(qs: Bytes) -> Bytes:
    """128 packed bytes -> 8 sub-blocks of 32: chunk c of 32 bytes gives sub-block 2c
    (low nibbles) and 2c+1 (high nibbles)."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0x0F, chunks >> 4], axis=2).reshape(-1, 8, 32)


def _scaled_with_min(blocks: Bytes, q: npt.NDArray[np.integer[Any]]) -> Floats:
    """x = d * scale * q - dmin * min, for the 8 sub-blocks of a Q4_K/Q5_K block."""
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d_scale = (_f16(blocks, 0) * scales)[:, :, None]
    d_min = (_f16(blocks, 2) * mins)[:, :, None]
    return (d_scale * q.astype(np.float32) - d_min).reshape(-1, 256)


def _q4_k(blocks: Bytes) -> Floats:
    return _scaled_with_min(blocks, _k_quants_4(blocks[:, 16:]))


def _q5_k(blocks: Bytes) -> Floats:
    qh = blocks[:, 16:48]  # bit j of qh[l] is bit 4 of element l of sub-block j
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return _scaled_with_min(blocks, _k_quants_4(blocks[:, 48:]) | (high << 4))


# For Q6_K: within each half of 128, element (nibble, chunk, l) = nibble*64 + chunk*32 + l
# takes its top two bits from qh[l] at this shift.
_Q6_SHIFTS = np.array([[0, 2], [4, 6]], dtype=np.uint8)[None, None, :, :, None]


def _q6_k(blocks: Bytes) -> Floats:
    ql = blocks[:, :128].reshape(-1, 2, 1, 2, 32)  # [n, half, -, chunk, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 1, 32)  # [n, half, -, -, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, half, nibble, chunk, l]
    high = (qh >> _Q6_SHIFTS) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d_scale = (_f16(blocks, 208) * scales)[:, :, None]  # one scale per 16 elements
    out: Floats = (d_scale * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, 256)
    return out


_Q = GGMLQuantizationType
_DECODERS: dict[GGMLQuantizationType, Callable[[Bytes], Floats]] = {
    _Q.F32: _f32,
    _Q.F16: _f16_type,
    _Q.BF16: _bf16,
    _Q.Q8_0: _q8_0,
    _Q.Q4_0: _q4_0,
    _Q.Q4_1: _q4_1,
    _Q.Q5_0: _q5_0,
    _Q.Q5_1: _q5_1,
    _Q.Q4_K: _q4_k,
    _Q.Q5_K: _q5_k,
    _Q.Q6_K: _q6_k,
}

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = tuple(_DECODERS)


def type_name(qtype: int) -> str:
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type id {qtype}"


def check_supported(qtype: int, what: str = "tensor") -> GGMLQuantizationType:
    """Return `qtype` as the enum, or raise `UnsupportedModelError` naming it."""
    if qtype not in _DECODERS:
        raise UnsupportedModelError(
            f"{what} uses GGUF type {type_name(qtype)}, which this engine cannot load; "
            f"supported types: {', '.join(t.name for t in SUPPORTED_TYPES)} "
            "(re-quantize the model to one of them)"
        )
    return GGMLQuantizationType(qtype)


def dequantize(raw: npt.NDArray[np.generic], qtype: int) -> Floats:
    """Decode a GGUF tensor's data to float32.

    `raw` is the tensor as `GGUFReader` exposes it: for block types a uint8 array
    `[..., row_bytes]`, for F32/F16 a typed array `[..., row]`. The result has the
    same leading shape and `row` columns (numpy order: the last axis is GGUF's ne0).
    """
    qtype = check_supported(qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    data = np.ascontiguousarray(raw).view(np.uint8)
    if data.ndim == 0 or data.shape[-1] % type_size:
        raise ValueError(
            f"{qtype.name} data of shape {raw.shape} is not a whole number of "
            f"{type_size}-byte blocks per row"
        )
    shape = (*data.shape[:-1], data.shape[-1] // type_size * block_size)
    blocks = data.reshape(-1, type_size)
    return _DECODERS[qtype](blocks).reshape(shape)
