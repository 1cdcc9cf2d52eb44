"""Byte layout of a worker's KV pool, shared by the engine, the transfer layer and peers.

    pool: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, row]

A row is head_dim elements of `dtype`, or, for the one-byte formats ("int8",
"float8_e4m3fn"), head_dim codes and an fp16 scale: head_dim + 2 bytes
(`kernels.kv_quant`), about half the bytes of bf16.

Block-major: block b's KV for every layer is the single byte range
[b * block_bytes, (b + 1) * block_bytes), so moving N blocks between engines takes N
descriptors (fewer once adjacent blocks coalesce). Two engines may exchange KV only
when their `layout_hash` (model, dtype, block size, head geometry, layers) matches;
the number of blocks may differ.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from protocol.declare import check_fields, spec
from protocol.errors import InvalidInput

ELEMENT_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}  # fmt: skip
QUANTIZED = ("int8", "float8_e4m3fn")  # rows of one-byte codes and an fp16 scale
SCALE_BYTES = 2


@dataclass(frozen=True)
class KvLayout:
    num_blocks: int = spec(lo=1)
    num_layers: int = spec(lo=1)
    block_size: int = spec(lo=1)
    num_kv_heads: int = spec(lo=1)
    head_dim: int = spec(lo=1)
    dtype: str = spec(choices=tuple(ELEMENT_BYTES))
    model: str = spec("", max_chars=1024)

    def __post_init__(self) -> None:
        check_fields(self, "kv_layout.")

    @property
    def element_size(self) -> int:
        return ELEMENT_BYTES[self.dtype]

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED

    @property
    def row_width(self) -> int:
        """Elements of one head's row: head_dim, or head_dim + 2 (a quantized row's
        scale)."""
        return self.head_dim + SCALE_BYTES if self.quantized else self.head_dim

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
            self.row_width,
        )  # fmt: skip

    @property
    def block_bytes(self) -> int:
        rows = self.num_layers * 2 * self.block_size * self.num_kv_heads
        return rows * self.row_width * self.element_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def layout_hash(self) -> str:
        key: dict[str, Any] = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "num_blocks"
        }
        key["order"] = "block,layer,kv,slot,head,dim"
        if self.quantized:
            key["row"] = f"{self.dtype} codes, fp16 scale"
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def block_range(self, block_id: int) -> tuple[int, int]:
        """(offset, length) in bytes of one block inside the pool."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} outside pool of {self.num_blocks}")
        return block_id * self.block_bytes, self.block_bytes

    def with_blocks(self, num_blocks: int) -> KvLayout:
        return dataclasses.replace(self, num_blocks=num_blocks)

    def to_dict(self) -> dict[str, Any]:
        """The fields, and the hash for readers that only compare it."""
        return {**dataclasses.asdict(self), "layout_hash": self.layout_hash}

    @classmethod
    def from_dict(cls, d: Any) -> KvLayout:
        """From `to_dict`'s output; a `layout_hash` given must be this layout's."""
        if not isinstance(d, dict):
            raise InvalidInput(f"kv_layout must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names - {"layout_hash"}
        if unknown:
            raise InvalidInput(f"kv_layout has no field(s) {sorted(unknown)}")
        try:
            layout = cls(**{k: v for k, v in d.items() if k in names})
        except TypeError as e:
            raise InvalidInput(f"kv_layout: {e}") from None
        claimed = d.get("layout_hash")
        if claimed is not None and claimed != layout.layout_hash:
            raise InvalidInput(
                f"kv_layout.layout_hash {claimed!r} is not its fields' ({layout.layout_hash})"
            )
        return layout
