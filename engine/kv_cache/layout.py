"""The KV pool as a tensor of its layout (`protocol.kv_layout.KvLayout`: the byte layout,
declared once for the engine, the transfer layer and peers)."""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocol.kv_layout import KvLayout


@dataclass(frozen=True)
class PoolMemory:
    """Memory an owner hands the engine for one rank's KV pool: this process's view of
    it and, for a pool another rank's process uses, the file that process maps (shared
    memory of this host; `None` where the memory is this process's alone)."""

    tensor: torch.Tensor
    path: str | None = None


# an owner's allocator: (nbytes, rank) -> the memory of that tensor-parallel rank's pool,
# or None: the engine allocates that pool itself (no peer reaches it)
KvAllocator = Callable[[int, int], PoolMemory | None]


def map_shared(path: str, nbytes: int) -> torch.Tensor:
    """The first `nbytes` of the shared file at `path` as a uint8 tensor (the mapping
    lives as long as the tensor)."""
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), nbytes, flags=mmap.MAP_SHARED)
    return torch.frombuffer(mm, dtype=torch.uint8)


def read_block_bytes(pool: torch.Tensor, block_ids: list[int]) -> list[torch.Tensor]:
    """Each block's bytes as a block-major pool holds them (every layer's K and V,
    quantized ones as codes and scales: one contiguous run), copied to the host. From a
    GPU pool into pinned (page-locked) host memory, every copy queued on the stream and
    waited for once: DMA at the link's speed, not a staged copy a block."""
    flat = pool.view(pool.shape[0], -1).view(torch.uint8)
    if not pool.is_cuda:
        return [flat[b].to("cpu", copy=True) for b in block_ids]
    rows = [torch.empty(flat.shape[1], dtype=torch.uint8, pin_memory=True) for _ in block_ids]
    for b, row in zip(block_ids, rows, strict=True):
        row.copy_(flat[b], non_blocking=True)
    torch.cuda.current_stream(pool.device).synchronize()  # the tier owns the bytes now
    return rows


def write_block_bytes(pool: torch.Tensor, block_ids: list[int], rows: list[torch.Tensor]) -> None:
    """`read_block_bytes`' rows back into blocks, one copy each (into a GPU pool from
    pinned rows, queued on the stream the next step runs on, so it reads them after)."""
    flat = pool.view(pool.shape[0], -1).view(torch.uint8)
    for b, row in zip(block_ids, rows, strict=True):
        flat[b].copy_(row, non_blocking=pool.is_cuda and row.is_pinned())


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
    if flat.device.type != device.type or device.index not in (None, flat.device.index):
        raise ValueError(f"KV pool on {flat.device}, engine on {device}")
    pool = flat.view(dtype).view(layout.shape)
    # Padding reads the null block and stale slots; they must hold finite numbers.
    pool.zero_()
    return pool
