"""Recover HF's `llama3` rope scaling from the `rope_freqs.weight` tensor of a GGUF.

llama.cpp does not store Llama 3.1/3.2 rope scaling as metadata: its converter
evaluates the scaling into one divisor per rotary frequency and stores those as
the tensor `rope_freqs`. HF describes the same thing with four numbers (factor,
low/high frequency factors, original context length). Per frequency `f` with
wavelength `w = 2π/f`, both compute the divisor

    1                                  if w < orig / high          (high frequencies)
    factor                             if w > orig / low           (low frequencies)
    1 / ((1 - s) / factor + s)         otherwise, s = (orig / w - low) / (high - low)

The divisors only pin down `factor`, `orig / (high - low)` and `low / (high - low)`,
so we take `orig` from the GGUF (or Llama 3's 8192) and solve for `low`, `high`.
We then recompute the divisors from the dict we return and refuse to guess if they
do not match the tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from engine.config import UnsupportedModelError

# Llama 3's pretraining context, the `original_max_position_embeddings` of every
# released Llama 3.x checkpoint.
LLAMA3_ORIGINAL_CONTEXT = 8192


def rope_divisors(
    rope_scaling: dict[str, Any], head_dim: int, theta: float
) -> npt.NDArray[np.float64]:
    """The per-frequency divisors that a `llama3` rope scaling dict applies."""
    factor = float(rope_scaling["factor"])
    low = float(rope_scaling["low_freq_factor"])
    high = float(rope_scaling["high_freq_factor"])
    orig = float(rope_scaling["original_max_position_embeddings"])
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _matches(
    rope_scaling: dict[str, Any], divisors: npt.NDArray[np.float64], head_dim: int, theta: float
) -> bool:
    return bool(np.allclose(rope_divisors(rope_scaling, head_dim, theta), divisors, rtol=1e-4))


def llama3_scaling_from_divisors(
    divisors: npt.NDArray[np.floating[Any]],
    head_dim: int,
    theta: float,
    original_context: int | None = None,
) -> dict[str, Any] | None:
    """HF `rope_scaling` dict equivalent to `divisors`, or None when they are all 1."""
    divs = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divs.shape[0] != head_dim // 2:
        raise UnsupportedModelError(
            f"rope_freqs has {divs.shape[0]} entries, expected head_dim/2 = {head_dim // 2}"
        )
    if np.allclose(divs, 1.0):
        return None
    factor = float(divs.max())
    orig = original_context or LLAMA3_ORIGINAL_CONTEXT
    candidate: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": orig,
    }
    if _matches(candidate, divs, head_dim, theta):
        return candidate

    # Not the released values: solve s = a / w + b on the frequencies in between.
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    mid = (divs > 1.0 + 1e-6) & (divs < factor * (1.0 - 1e-6))
    if factor > 1.0 and mid.sum() >= 2:
        smooth = (1.0 / divs[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(1.0 / wavelen[mid], smooth, 1)
        span = orig / a  # high - low
        low = -b * span
        for digits in (3, 6, None):
            lo = low if digits is None else round(low, digits)
            hi = low + span if digits is None else round(low + span, digits)
            candidate.update(low_freq_factor=float(lo), high_freq_factor=float(hi))
            if _matches(candidate, divs, head_dim, theta):
                return candidate
    raise UnsupportedModelError(
        "the GGUF's rope_freqs tensor does not follow Llama 3 rope scaling; "
        "this engine cannot reproduce its rotary frequencies"
    )
