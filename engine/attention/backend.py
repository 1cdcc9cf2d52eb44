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


class AttentionBackend(ABC):
    name: str = "abstract"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window

    @abstractmethod
    def prepare(self, batch: BatchLayout) -> Any:
        """Per-step metadata shared by all layers."""

    @abstractmethod
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


def get_backend_class(name: str, device: torch.device) -> type[AttentionBackend]:
    """Pick a backend: "torch" (any device), "triton", or "auto" (Triton on CUDA when
    the triton package imports, torch elsewhere).

    "triton" off CUDA runs only with the kernels forced to Triton
    (`DIPTYCH_KERNELS=triton` / `kernels.ops.set_backend("triton")`) and Triton's
    interpreter (TRITON_INTERPRET=1): a test configuration, slow but exact.
    """
    from engine.attention.torch_backend import TorchAttention
    from engine.attention.triton_backend import TritonAttention
    from kernels import ops

    if name == "torch":
        return TorchAttention
    if name == "auto":
        if device.type == "cuda" and ops.get_backend() != "torch" and ops.triton_available():
            return TritonAttention
        return TorchAttention
    if name == "triton":
        if not ops.triton_available():
            raise ValueError("attention_backend='triton' needs the triton package")
        forced = ops.get_backend() == "triton" and ops.triton_runs_on(device)
        if device.type != "cuda" and not forced:
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device (got {device}); on CPU it "
                "runs only for tests, with DIPTYCH_KERNELS=triton and TRITON_INTERPRET=1"
            )
        return TritonAttention
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch, triton")
