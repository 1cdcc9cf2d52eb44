"""Our numpy dequantizers against gguf-py's reference and against hand-built blocks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from engine.config import UnsupportedModelError
from engine.weights.dequant import SUPPORTED_TYPES, dequantize

Q = GGMLQuantizationType
QUANTIZABLE = [Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # gguf.quants.quantize works
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]  # gguf-py can only dequantize these


def _weights(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x.reshape(-1)[::97] *= 20  # outliers, so block scales differ a lot
    x.reshape(-1)[5::101] = 0.0
    return x


def _random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid blocks of a type gguf-py cannot quantize: random quants, finite scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    scales = (rng.standard_normal((blocks.shape[0], 2)) * 0.05).astype(np.float16)
    if qtype == Q.Q6_K:  # d is the last two bytes
        blocks[:, -2:] = scales[:, :1].view(np.uint8)
    else:  # d, dmin lead the block
        blocks[:, :4] = np.abs(scales).view(np.uint8)
    return raw


def test_supported_types_are_the_promised_ones() -> None:
    promised = {
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q4_K",
        "Q5_K",
        "Q6_K",
    }
    assert {t.name for t in SUPPORTED_TYPES} == promised


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_matches_gguf_reference_on_quantized_data(qtype: GGMLQuantizationType) -> None:
    x = _weights((24, 512))
    raw = quants.quantize(x, qtype)
    ours = dequantize(raw, qtype)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_matches_gguf_reference_on_random_k_blocks(qtype: GGMLQuantizationType) -> None:
    raw = _random_blocks(qtype, rows=12, cols=1024, seed=int(qtype))
    ours = dequantize(raw, qtype)
    assert ours.dtype == np.float32 and ours.shape == (12, 1024)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, quants.dequantize(raw, qtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["F32", "F16"])
def test_float_types_are_plain_casts(dtype: type) -> None:
    x = _weights((3, 5, 64)).astype(dtype)
    qtype = Q.F32 if dtype == np.float32 else Q.F16
    np.testing.assert_array_equal(dequantize(x, qtype), x.astype(np.float32))


def test_leading_dimensions_are_kept() -> None:
    x = _weights((2, 3, 64))
    raw = quants.quantize(x, Q.Q8_0)
    assert raw.shape == (2, 3, 68)
    np.testing.assert_array_equal(dequantize(raw, Q.Q8_0), quants.dequantize(raw, Q.Q8_0))


def test_bf16_is_the_top_half_of_float32() -> None:
    x = np.array([1.0, -2.5, 3.140625, 0.0], dtype=np.float32)
    raw = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    np.testing.assert_array_equal(dequantize(raw, Q.BF16), x)


def test_hand_built_q4_0_block() -> None:
    # d = 0.5; byte j holds quant j (low nibble) and quant j + 16 (high nibble).
    lo = np.arange(16, dtype=np.uint8)
    hi = (15 - np.arange(16)).astype(np.uint8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), lo | (hi << 4)])
    expected = 0.5 * (np.concatenate([lo, hi]).astype(np.float32) - 8)
    np.testing.assert_array_equal(dequantize(block[None], Q.Q4_0)[0], expected)


def test_hand_built_q5_1_block() -> None:
    # x = d * q + m; q's bit 4 for element i is bit i of the little-endian u32.
    d, m = np.float16(0.25), np.float16(-1.0)
    q = np.arange(32, dtype=np.uint8)  # every 5-bit value once
    qs = (q[:16] & 0x0F) | ((q[16:] & 0x0F) << 4)
    qh = np.array([int(sum(((int(v) >> 4) & 1) << i for i, v in enumerate(q)))], dtype="<u4")
    head = np.array([d, m], dtype=np.float16).view(np.uint8)
    block = np.concatenate([head, qh.view(np.uint8), qs])
    expected = np.float32(d) * q.astype(np.float32) + np.float32(m)
    np.testing.assert_array_equal(dequantize(block[None], Q.Q5_1)[0], expected)


def test_hand_built_q6_k_block() -> None:
    # All quants 33 (q - 32 = 1), d = 2, scales 0..15: element e is 2 * (e // 16).
    ql = np.full(128, 0x11, dtype=np.uint8)  # low 4 bits of 33 are 1 in both nibbles
    qh = np.full(64, 0b10101010, dtype=np.uint8)  # top 2 bits of 33 are 0b10 for all four
    scales = np.arange(16, dtype=np.int8).view(np.uint8)
    d = np.array([2.0], np.float16).view(np.uint8)
    block = np.concatenate([ql, qh, scales, d])
    expected = 2.0 * (np.arange(256) // 16).astype(np.float32)
    np.testing.assert_array_equal(dequantize(block[None], Q.Q6_K)[0], expected)


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.Q8_1, Q.I32])
def test_unsupported_type_is_named(qtype: GGMLQuantizationType) -> None:
    with pytest.raises(UnsupportedModelError, match=qtype.name):
        dequantize(np.zeros((1, 256), np.uint8), qtype)


def test_unknown_type_id() -> None:
    with pytest.raises(UnsupportedModelError, match="unknown type id 99"):
        dequantize(np.zeros((1, 34), np.uint8), 99)


def test_partial_block_is_rejected() -> None:
    with pytest.raises(ValueError, match="whole number"):
        dequantize(np.zeros((2, 33), np.uint8), Q.Q8_0)
