"""The int8 KV cache format (`EngineConfig.kv_cache_dtype="int8"`).

Each token's K (and V) row of one KV head is stored as `head_dim` int8 codes followed
by its scale, an fp16 in the row's last two bytes:

    cache row:  | code_0 ... code_{D-1} | scale (fp16, 2 bytes) |    int8 [..., D + 2]
    value_i = code_i * scale,   scale = max_i |x_i| / 127,   code_i = round(x_i / scale)

A scale per token and head is dynamic (no calibration) and bounds each value's error
by scale / 2; keeping it inside the row keeps a block's KV one contiguous byte range
(what the transfer layer moves) and puts the scale in the cache line its codes are
read from. A row costs D + 2 bytes against 2 D in bf16: 66 / 128 at D = 64.

A cache tensor of dtype int8 is in this format; every kernel that reads or writes a
cache (`kernels.ops.store_kv`, the attention kernels) checks the dtype.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2
QMAX = 127.0


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int) -> int:
    """Bytes of one token's row of one KV head: the codes and the scale."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., D] (any float dtype) as int8 [..., D + 2], codes then scale.
    The codes are computed against the scale as stored (rounded to fp16)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / QMAX).to(torch.float16)
    sf = scale.float()
    codes = torch.where(sf > 0, torch.round(xf / sf.clamp_min(1e-30)), 0.0)
    out = torch.empty((*x.shape[:-1], row_width(x.shape[-1])), dtype=torch.int8, device=x.device)
    out[..., : x.shape[-1]] = codes.clamp_(-QMAX, QMAX).to(torch.int8)
    out[..., x.shape[-1] :] = scale.view(torch.int8)
    return out


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The fp16 scales [...] of int8 rows [..., D + 2]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float16)[..., 0]


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + 2] back to values [..., D] in `dtype`."""
    codes = rows[..., :-SCALE_BYTES].float()
    return (codes * scales(rows).float()[..., None]).to(dtype)
