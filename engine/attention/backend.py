"""The attention interface the model calls: the step's shape (`BatchLayout`), the
backend interface, and the backend registry.

A backend turns a `BatchLayout` into its own metadata once per step
(`prepare`), then for every layer stores the new K/V rows in the paged cache and
attends over it (`forward`). The model never sees block tables.

KV cache layout (one tensor for all layers, block-major so a block's KV for every
layer is one contiguous byte range, which is what the transfer layer moves):

    pool:         [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer view:   pool[:, layer] -> [num_blocks, 2, block_size, num_kv_heads, head_dim]

The shape of one forward step, as every backend sees it (`BatchLayout`): the tokens of
all scheduled sequences flattened into one ragged batch:

    tokens:           | seq 0 (q_len 1) | seq 1 (q_len 1) | seq 2 (q_len 5)      |
    query_start_loc:  0                 1                 2                      7
    seq_lens:         = tokens with KV after this step (cached prefix + new tokens)
    positions:        seq_len - q_len ... seq_len - 1, per sequence
    slot_mapping:     block_table[pos // block_size] * block_size + pos % block_size

Sequences with q_len == 1 (decodes) come first, so backends can batch them.
`block_table` rows are padded with block 0, the null block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from kernels import ops
from kernels.ops import KernelSelection


@dataclass
class BatchLayout:
    query_start_loc: np.ndarray  # int64 [num_seqs + 1]
    seq_lens: np.ndarray  # int64 [num_seqs]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    block_table: np.ndarray  # int32 [num_seqs, max_blocks]
    num_decodes: int
    block_size: int
    device: torch.device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        num_computed: list[int],
        block_ids: list[list[int]],
        block_size: int,
        device: torch.device,
    ) -> BatchLayout:
        """Lay out a step from per-sequence (new tokens, computed tokens, block ids)."""
        q = np.asarray(query_lens, dtype=np.int64)
        start = np.asarray(num_computed, dtype=np.int64)
        qsl = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        seq_lens = start + q
        # positions: for each token, its sequence's start + index within the chunk
        seq_of_token = np.repeat(np.arange(len(q)), q)
        positions = start[seq_of_token] + (np.arange(qsl[-1]) - qsl[seq_of_token])
        max_blocks = max((len(b) for b in block_ids), default=1) or 1
        table = np.zeros((len(q), max_blocks), dtype=np.int32)
        for i, b in enumerate(block_ids):
            table[i, : len(b)] = b
        slots = (
            table[seq_of_token, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )
        num_decodes = 0
        while num_decodes < len(q) and q[num_decodes] == 1:
            num_decodes += 1
        return cls(qsl, seq_lens, positions, slots, table, num_decodes, block_size, device)


@dataclass(eq=False)
class AttentionBackend(ABC):
    """`kernels` runs the backend's ops (default: `kernels.ops.DEFAULT`): give it the
    `Kernels` of the selection `get_backend_class` chose the backend with, so that the
    attention and the ops it calls agree."""

    name: ClassVar[str] = "abstract"

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    kernels: ops.Kernels = field(default_factory=lambda: ops.DEFAULT)

    @abstractmethod
    def prepare(self, batch: BatchLayout) -> Any:
        """Per-step metadata shared by all layers; it carries the step's `slots`."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:
        """Store k/v [T, kv_heads, d] into `kv_cache` (this layer's view), attend with
        q [T, heads, d], and return [T, heads * d]."""
        t, h, d = q.shape
        k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
        self.kernels.store_kv(k, v, k_cache, v_cache, meta.slots)
        return self.attend(q, k, v, k_cache, v_cache, meta).view(t, h * d)

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor:
        """[T, heads, d]: q over caches that already hold this step's k/v (also given
        as they are, for sequences with no context in the cache)."""


def get_backend_class(
    name: str, device: torch.device, selection: KernelSelection | None = None
) -> type[AttentionBackend]:
    """The backend for `EngineConfig.attention_backend` `name` ("auto", "torch" or
    "triton") on `device`, as `selection` (default: `kernels.ops.DEFAULT`'s) decides it
    (`KernelSelection.attention`): "triton" is `TritonAttention`, "torch"
    `TorchAttention`."""
    from engine.attention.torch_backend import TorchAttention
    from engine.attention.triton_backend import TritonAttention

    chosen = (selection or ops.DEFAULT.selection).attention(name, device)
    return TritonAttention if chosen == "triton" else TorchAttention
