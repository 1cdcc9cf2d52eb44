"""The attention interface the model calls, and the backend registry.

A backend turns a `BatchLayout` into its own metadata once per step
(`prepare`), then for every layer stores the new K/V rows in the paged cache and
attends over it (`forward`). The model never sees block tables.

KV cache layout (one tensor for all layers, block-major so a block's KV for every
layer is one contiguous byte range, which is what the transfer layer moves):

    pool:         [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer view:   pool[:, layer] -> [num_blocks, 2, block_size, num_kv_heads, head_dim]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from engine.attention.batch import BatchLayout
from kernels import ops
from kernels.selection import KernelSelection


class AttentionBackend(ABC):
    """`kernels` runs the backend's ops (default: `kernels.ops.DEFAULT`): give it the
    `Kernels` of the selection `get_backend_class` chose the backend with, so that the
    attention and the ops it calls agree."""

    name: str = "abstract"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        kernels: ops.Kernels | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kernels = kernels or ops.DEFAULT

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
