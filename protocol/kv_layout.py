"""The KV contracts between workers: the byte layout of a pool (`KvLayout`, shared by
the engine, the transfer layer and peers) and the block-hash chain that names cached KV.

    pool: [num_blocks, num_layers, kv_planes, block_size, num_kv_heads, row]

`kv_planes` is 2 (K, then V), or 1 for multi-head latent attention (DeepSeek): one
latent row a token, read as both K and V, one "KV head" of kv_lora_rank + rotary
values.

A row is head_dim elements of `dtype`, or, for the one-byte formats ("int8",
"float8_e4m3fn"), head_dim codes and an fp16 scale: head_dim + 2 bytes
(`kernels.kv_quant`), about half the bytes of bf16.

Under tensor parallelism each rank's pool has this layout over its own KV heads
(`tp_size`, `model_kv_heads`, `rank_heads`), and a worker publishes rank 0's. Two
workers at different TP sizes exchange KV when their `format_hash` (the layout
hash of the unsplit pool) matches: `head_slices` says which run of KV heads of which
source rank goes to which destination rank.

Block-major: block b's KV for every layer is the single byte range
[b * block_bytes, (b + 1) * block_bytes), so moving N blocks between engines takes N
descriptors (fewer once adjacent blocks coalesce). Two engines may exchange KV only
when their `layout_hash` (model, dtype, block size, head geometry, layers) matches;
the number of blocks may differ.

The chained block hashes that name cached KV: the prefix cache's keys, and what
workers report and routers compute. The chain is a wire contract, like the messages:

    hash(block i) = blake2b-64(hash(block i-1) as 8 little-endian bytes, or 8 zero bytes,
                               the block's token ids as little-endian uint32,
                               b"\\xff" + cache salt, in block 0 only, if there is a salt,
                               b"\\xfe" + the LoRA adapter's key, in block 0 only, for a
                               request to an adapter (protocol.lora.AdapterRef.hash_key))

read as a little-endian integer. Only full blocks are hashed. The chain makes a
block's hash name its whole prefix, so equal hashes mean equal KV; a cache salt (for
tenants that must not share cache) enters the first block and so every block after it,
and so does a LoRA adapter (KV computed with one adapter is another adapter's or the
base model's miss). UTF-8 never writes the bytes 0xfe and 0xff, so no salt is an
adapter's key.
"""

from __future__ import annotations

import array
import dataclasses
import enum
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.declare import check_fields, spec
from protocol.errors import InvalidInput
from protocol.lora import AdapterRef

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
    # Tensor parallelism: the worker's pool is split over `tp_size` ranks by KV head,
    # each rank's pool in this layout holding `num_kv_heads` of the model's
    # `model_kv_heads` (`rank_heads` says which; 0: the model's are these).
    tp_size: int = spec(1, lo=1, hi=1024)
    model_kv_heads: int = spec(0, lo=0)
    kv_planes: int = spec(2, lo=1, hi=2)

    def __post_init__(self) -> None:
        check_fields(self, "kv_layout.")
        if self.tp_size > 1 and len(self.rank_heads(0)) != self.num_kv_heads:
            raise InvalidInput(
                f"kv_layout: {self.model_kv_heads} KV heads over {self.tp_size} ranks do "
                f"not give {self.num_kv_heads} a rank"
            )

    def rank_heads(self, rank: int) -> tuple[int, ...]:
        """The model's KV heads the pool of rank `rank` holds, in order."""
        return kv_heads_of(rank, self.tp_size, self.model_kv_heads or self.num_kv_heads)

    def differences(self, other: KvLayout) -> list[str]:
        """What keeps two pools from exchanging KV: each field of their unsplit
        layouts (the block count aside) that differs, as "name ours vs theirs"."""
        ours, theirs = self.unsplit(), other.unsplit()
        return [
            f"{f.name} {getattr(ours, f.name)!r} vs {getattr(theirs, f.name)!r}"
            for f in dataclasses.fields(ours)
            if f.name != "num_blocks" and getattr(ours, f.name) != getattr(theirs, f.name)
        ]

    def unsplit(self) -> KvLayout:
        """The layout of the whole pool: every rank's KV heads in one."""
        if self.tp_size == 1 and not self.model_kv_heads:
            return self
        heads = self.model_kv_heads or self.num_kv_heads
        return dataclasses.replace(self, num_kv_heads=heads, tp_size=1, model_kv_heads=0)

    @property
    def format_hash(self) -> str:
        """What two workers compare before exchanging KV, whatever their TP sizes: the
        unsplit pool's `layout_hash` (equal to `layout_hash` when not split)."""
        return self.unsplit().layout_hash

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head's row (one slot, one layer, K or V)."""
        return self.row_width * self.element_size

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
            self.num_blocks, self.num_layers, self.kv_planes, self.block_size,
            self.num_kv_heads, self.row_width,
        )  # fmt: skip

    @property
    def block_bytes(self) -> int:
        rows = self.num_layers * self.kv_planes * self.block_size * self.num_kv_heads
        return rows * self.head_bytes

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
        if self.tp_size == 1:  # a pool that is not split hashes as it always has
            del key["tp_size"], key["model_kv_heads"]
        if self.kv_planes == 2:  # K and V, as every layout before latent caches
            del key["kv_planes"]
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
        """The fields, and the hash for readers that only compare it. `kv_planes` only
        when it is not 2 (a latent cache), so a K/V layout's record is what peers of
        every version read."""
        d = dataclasses.asdict(self)
        if self.kv_planes == 2:
            del d["kv_planes"]
        return {**d, "layout_hash": self.layout_hash}

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


def kv_heads_of(rank: int, size: int, kv_heads: int) -> tuple[int, ...]:
    """The KV heads rank `rank` of `size` holds: an even share of the `kv_heads`, or,
    with fewer heads than ranks (GQA), the one head it shares with `size / kv_heads`
    ranks (as vLLM replicates them)."""
    if not 0 <= rank < size:
        raise InvalidInput(f"rank {rank} is not in [0, {size})")
    if kv_heads >= size:
        if kv_heads % size:
            raise InvalidInput(f"{kv_heads} KV heads do not split evenly over {size} ranks")
        n = kv_heads // size
        return tuple(range(rank * n, (rank + 1) * n))
    if size % kv_heads:
        raise InvalidInput(f"{size} ranks do not share {kv_heads} KV heads evenly")
    return (rank // (size // kv_heads),)


@dataclass(frozen=True)
class HeadSlice:
    """A run of `count` KV heads that source rank `src_rank` holds from position
    `src_head` of its pool's heads and destination rank `dst_rank` holds from
    position `dst_head` of its own."""

    src_rank: int
    src_head: int
    dst_rank: int
    dst_head: int
    count: int


def head_slices(src: KvLayout, dst: KvLayout) -> list[HeadSlice]:
    """Which heads of which source rank fill each destination rank's pool: every
    destination rank gets each of its heads once, from the first source rank holding
    it (a head that GQA replicates over several source ranks is read from one of
    them; one replicated over several destination ranks is written to each). Runs of
    consecutive heads are one slice. Raises InvalidInput when the pools do not hold
    the same model heads (see `differences`)."""
    if src.format_hash != dst.format_hash:
        why = "; ".join(src.differences(dst))
        raise InvalidInput(f"KV layouts cannot exchange KV ({why})")
    holder: dict[int, tuple[int, int]] = {}  # model head -> (source rank, position)
    for rank in range(src.tp_size):
        for pos, head in enumerate(src.rank_heads(rank)):
            holder.setdefault(head, (rank, pos))
    out: list[HeadSlice] = []
    for rank in range(dst.tp_size):
        for pos, head in enumerate(dst.rank_heads(rank)):
            s_rank, s_pos = holder[head]
            last = out[-1] if out else None
            if (
                last is not None and last.dst_rank == rank and last.src_rank == s_rank
                and last.dst_head + last.count == pos and last.src_head + last.count == s_pos
            ):  # fmt: skip
                out[-1] = dataclasses.replace(last, count=last.count + 1)
            else:
                out.append(HeadSlice(s_rank, s_pos, rank, pos, 1))
    return out


BlockHash = int


class KvTier(enum.IntEnum):
    """Where a worker's nearest copy of a cached block is: its KV pool, or a tier under
    it (engine/kv_cache/tiers.py). KV events carry it, and routers price a hit by it."""

    DEVICE = 0
    HOST = 1
    DISK = 2

_NO_PARENT = b"\x00" * 8


def _le_u32(token_ids: Sequence[int]) -> bytes:
    data = array.array("I", token_ids)
    if data.itemsize != 4:  # "I" is 4 bytes on every platform Diptych runs on
        data = array.array("L", token_ids)
    if sys.byteorder == "big":
        data.byteswap()
    return data.tobytes()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start: int = 0,
    parent: BlockHash | None = None,
    salt: str | None = None,
    adapter: AdapterRef | None = None,
) -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids` from block index `start` on;
    `parent` must be the hash of block `start - 1` (None when start is 0)."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(token_ids) // block_size
    if n_full <= start:
        return []
    step = block_size * 4
    data = _le_u32(token_ids[start * block_size : n_full * block_size])
    blake, from_bytes = hashlib.blake2b, int.from_bytes
    prev = _NO_PARENT if parent is None else parent.to_bytes(8, "little")
    out: list[BlockHash] = []
    for i in range(n_full - start):  # one-shot constructors: ~15 % faster than update()
        chunk = data[i * step : (i + 1) * step]
        if i + start == 0:
            chunk += _first_block_keys(salt, adapter)
        prev = blake(prev + chunk, digest_size=8).digest()
        out.append(from_bytes(prev, "little"))
    return out


def _first_block_keys(salt: str | None, adapter: AdapterRef | None) -> bytes:
    return (b"\xff" + salt.encode() if salt else b"") + (
        b"\xfe" + adapter.hash_key if adapter is not None else b""
    )


def hash_block(
    parent: BlockHash | None,
    token_ids: Sequence[int],
    salt: str | None = None,
    adapter: AdapterRef | None = None,
) -> BlockHash:
    """One link of the chain: the hash of a block after `parent` (None: the first);
    give `salt` and `adapter` for the first block only."""
    data = _le_u32(token_ids) + _first_block_keys(salt, adapter)
    prev = _NO_PARENT if parent is None else parent.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(prev + data, digest_size=8).digest(), "little")
