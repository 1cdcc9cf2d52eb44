"""The quantized KV cache formats (`EngineConfig.kv_cache_dtype` "int8" and "fp8").

Each token's K (and V) row of one KV head is stored as `head_dim` one-byte codes
followed by its scale, an fp16 in the row's last two bytes:

    cache row:  | code_0 ... code_{D-1} | scale (fp16, 2 bytes) |    [..., D + 2]
    value_i = decode(code_i) * scale,   scale = max_i |x_i| / QMAX

    int8   (cache dtype torch.int8)          codes round(x / scale), QMAX 127
    fp8    (cache dtype torch.float8_e4m3fn) codes x / scale rounded to e4m3 (nearest
           even, 3 mantissa bits), QMAX 448, e4m3's largest finite value

A scale per token and head is dynamic (no calibration). int8 bounds each value's
error by scale / 2, the same for every value of the row; fp8 bounds it relative to
the value (2^-4 of it), so small values keep more precision and the row's largest
ones less. Keeping the scale inside the row keeps a block's KV one contiguous byte
range (what the transfer layer moves) and puts it in the cache line its codes are
read from. A row costs D + 2 bytes against 2 D in bf16: 66 / 128 at D = 64.

No kernel needs fp8 arithmetic: e4m3 codes widen to fp32 with integer operations
(`kernels/csrc/vec16.h`, `kernels/triton/kv_codes.py`), so the format runs on every
CPU and GPU. A cache tensor of one of these dtypes is in its format; every kernel
that reads or writes a cache (`kernels.ops.store_kv`, the attention kernels) checks
the dtype.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# each format's name (`cpu_ops.dispatch_report`'s kv_quantized)
FORMATS = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
# `EngineConfig.kv_cache_dtype` name -> the pool's dtype name (`KvLayout.dtype`)
POOL_DTYPES = {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in QMAX


def format_of(pool_dtype: str) -> str:
    """The format a pool dtype name (`KvLayout.dtype`) holds ("int8", "fp8"), or ""
    for a float cache."""
    dtype = getattr(torch, pool_dtype, None)
    return FORMATS.get(dtype, "") if isinstance(dtype, torch.dtype) else ""


def is_quantized_name(pool_dtype: str) -> bool:
    """Whether a pool dtype name (`KvLayout.dtype`) is one of these formats."""
    return bool(format_of(pool_dtype))


def row_width(head_dim: int) -> int:
    """Bytes of one token's row of one KV head: the codes and the scale."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows x [..., D] (any float dtype) as `dtype` rows [..., D + 2], codes then
    scale. The codes are computed against the scale as stored (rounded to fp16)."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / qmax).to(torch.float16)
    sf = scale.float()
    scaled = torch.where(sf > 0, xf / sf.clamp_min(1e-30), 0.0).clamp_(-qmax, qmax)
    out = torch.empty((*x.shape[:-1], row_width(x.shape[-1])), dtype=dtype, device=x.device)
    if dtype == torch.int8:
        out[..., : x.shape[-1]] = torch.round(scaled).to(torch.int8)
    else:
        out[..., : x.shape[-1]] = scaled.to(dtype)
    out[..., x.shape[-1] :] = scale.view(dtype)
    return out


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The fp16 scales [...] of quantized rows [..., D + 2]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float16)[..., 0]


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantized rows [..., D + 2] back to values [..., D] in `dtype`."""
    codes = rows[..., :-SCALE_BYTES].float()
    return (codes * scales(rows).float()[..., None]).to(dtype)


def cache_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The blocks `block_ids` of a cache [blocks, block, KVH, D(+2)] as values in
    `dtype`: int8 / fp8 caches (these formats) dequantized, others as stored."""
    rows = cache[block_ids.long()]
    return dequantize(rows, dtype) if is_quantized(cache) else rows
