"""The KV pool as a tensor of its layout (`protocol.kv_layout.KvLayout`: the byte layout,
declared once for the engine, the transfer layer and peers)."""

from __future__ import annotations

import torch

from protocol.kv_layout import KvLayout


def pool_tensor(
    layout: KvLayout, device: torch.device, memory: torch.Tensor | None
) -> torch.Tensor:
    """The pool as a tensor of `layout.shape` and dtype: new zeros, or a zeroed view of
    `memory` (the owner's, at least `layout.total_bytes` long, on `device`)."""
    dtype = getattr(torch, layout.dtype)
    if memory is None:
        return torch.zeros(layout.shape, dtype=dtype, device=device)
    flat = memory.view(torch.uint8).reshape(-1)[: layout.total_bytes]
    if flat.numel() < layout.total_bytes:
        raise ValueError(
            f"the KV pool memory holds {flat.numel()} bytes, the layout needs {layout.total_bytes}"
        )
    if flat.device != device:
        raise ValueError(f"KV pool on {flat.device}, engine on {device}")
    pool = flat.view(dtype).view(layout.shape)
    # Padding reads the null block and stale slots; they must hold finite numbers.
    pool.zero_()
    return pool
