"""Write a step's new K/V rows into their slots of the paged cache.

    k, v:            [T, kv_heads, head_dim]   (strided views of the qkv output are fine)
    k_cache/v_cache: [num_blocks, block_size, kv_heads, head_dim]   (a layer's view of the pool)
    slots:           [T], slot = block * block_size + offset; -1 marks padding: skipped

One program per token copies all of its heads; the copy moves bits (the tensors are
reinterpreted as integers of the same width), so any 2- or 4-byte dtype works. int8
and fp8 caches ([..., head_dim + 2], kernels/kv_quant.py) take each head's row
quantized instead: codes x / s rounded (to an integer, or to e4m3; half to even, as
torch), then s = max|x| / QMAX as fp16.
"""

from __future__ import annotations

import torch
import triton.language as tl

from kernels.kv_quant import QMAX, SCALE_BYTES
from kernels.triton.contract import as_words, float_tensor, index_tensor, next_pow2
from kernels.triton.jit import device_function, kernel
from kernels.triton.kv_codes import FLOAT, code_view, encode_e4m3, kv_codes, round_half_even


@kernel
def store_kv_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_cb: tl.tensor,
    stride_cs: tl.tensor,
    stride_ch: tl.tensor,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_CODES: tl.constexpr,  # int8 / fp8 caches (kv_codes.py) quantize each row, else copy bits
    QMAX: tl.constexpr,
) -> None:
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    # A padding slot (-1) masks the whole row instead of branching. (The scalar test
    # is broadcast before the `&`: Triton's interpreter mis-types scalar & tensor.)
    row_ok = (h < NUM_HEADS) & (h * 0 + slot >= 0)
    mask = row_ok & (d < HEAD_DIM)
    row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0)
    if KV_CODES > 0:
        quantize_rows(k.to(tl.float32), k_cache_ptr + row, d, row_ok, HEAD_DIM, KV_CODES, QMAX)
        quantize_rows(v.to(tl.float32), v_cache_ptr + row, d, row_ok, HEAD_DIM, KV_CODES, QMAX)
    else:
        tl.store(k_cache_ptr + row + d, k, mask=mask)
        tl.store(v_cache_ptr + row + d, v, mask=mask)


@device_function
def quantize_rows(
    x: tl.tensor,
    row_ptr: tl.tensor,
    d: tl.tensor,
    row_ok: tl.tensor,
    HEAD_DIM: tl.constexpr,
    KV_CODES: tl.constexpr,
    QMAX: tl.constexpr,
) -> None:
    """Store fp32 rows x [heads, dim] (0 past HEAD_DIM) at row_ptr [heads, 1] as codes
    and fp16 scales, the rows where row_ok [heads, 1]."""
    scale = (tl.max(tl.abs(x), axis=1) / QMAX).to(tl.float16)
    sf = scale.to(tl.float32)[:, None]
    c = tl.where(sf > 0.0, x / tl.where(sf > 0.0, sf, 1.0), 0.0)
    c = tl.minimum(tl.maximum(c, -QMAX), QMAX)
    if KV_CODES == 2:
        codes = encode_e4m3(c)
    else:
        codes = round_half_even(c).to(tl.int8)
    tl.store(row_ptr + d, codes, mask=row_ok & (d < HEAD_DIM))
    scale_ptr = (row_ptr + HEAD_DIM).to(tl.pointer_type(tl.float16))
    tl.store(scale_ptr, scale[:, None], mask=row_ok)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    t, kvh, d = k.shape
    codes = kv_codes(k_cache)
    width = d + SCALE_BYTES if codes != FLOAT else d
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (kvh, width) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not take rows of "
            f"[{kvh}, {d}]: expected [num_blocks, block_size, {kvh}, {width}]"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides (two views of one pool)")
    if codes != FLOAT and v_cache.dtype == k_cache.dtype and k.dtype == v.dtype:
        float_tensor("k", k)
    elif not k.dtype == v.dtype == k_cache.dtype == v_cache.dtype:
        raise TypeError(
            f"k/v ({k.dtype}, {v.dtype}) and caches ({k_cache.dtype}, {v_cache.dtype}) "
            "must share one dtype"
        )
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride on head_dim, got {x.stride()}")
    slots = index_tensor("slot_mapping", slots, k.device, 1)
    if slots.shape[0] != t:
        raise ValueError(f"slot_mapping has {slots.shape[0]} entries for {t} tokens")
    if t == 0:
        return
    if codes != FLOAT:
        kw, vw, kcw, vcw = k, v, code_view(k_cache), code_view(v_cache)
    else:
        kw, vw, kcw, vcw = map(as_words, (k, v, k_cache, v_cache))
    store_kv_kernel[(t,)](
        kw,
        vw,
        kcw,
        vcw,
        slots,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=kvh,
        HEAD_DIM=d,
        HEADS_PAD=next_pow2(kvh),
        DIM_PAD=next_pow2(d),
        BLOCK_SIZE=k_cache.shape[1],
        KV_CODES=codes,
        QMAX=QMAX.get(k_cache.dtype, 0.0),
    )
