"""Byte layout of the KV pool, shared with the transfer layer and peers.

    pool: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

With dtype "int8" or "float8_e4m3fn" each head's row is head_dim one-byte codes and an
fp16 scale, head_dim + 2 bytes (`kernels.kv_quant`): a block takes about half the
bytes of bf16.

Block-major: block b's KV for every layer is the single byte range
[b * block_bytes, (b + 1) * block_bytes), so moving N blocks between engines takes
N descriptors (fewer once adjacent blocks coalesce). Two engines may exchange KV
only when their `layout_hash` (model, dtype, block size, head geometry, layers)
matches; the number of blocks may differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch

from kernels import kv_quant


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    model: str = ""

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    @property
    def row_width(self) -> int:
        """Elements of one head's row: head_dim, or head_dim + 2 (a quantized row's
        scale)."""
        if kv_quant.is_quantized_name(self.dtype):
            return kv_quant.row_width(self.head_dim)
        return self.head_dim

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_blocks,
            self.num_layers,
            2,
            self.block_size,
            self.num_kv_heads,
            self.row_width,
        )

    @property
    def block_bytes(self) -> int:
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row_width
        ) * self.element_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def layout_hash(self) -> str:
        key = {k: v for k, v in self.to_dict().items() if k != "num_blocks"}
        key["order"] = "block,layer,kv,slot,head,dim"
        if kv_quant.is_quantized_name(self.dtype):
            key["row"] = f"{self.dtype} codes, fp16 scale"
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def block_range(self, block_id: int) -> tuple[int, int]:
        """(offset, length) in bytes of one block inside the pool."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside pool of {self.num_blocks}")
        return block_id * self.block_bytes, self.block_bytes

    def with_blocks(self, num_blocks: int) -> KVLayout:
        return dataclasses.replace(self, num_blocks=num_blocks)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def pool_tensor(
    layout: KVLayout, device: torch.device, memory: torch.Tensor | None
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
