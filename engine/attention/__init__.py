"""Attention over the paged KV cache: the step layout and the backends."""

from engine.attention.backend import (
    AttentionBackend,
    BatchLayout,
    TorchAttention,
    get_backend_class,
)
from engine.attention.triton_backend import TritonAttention

__all__ = [
    "AttentionBackend",
    "BatchLayout",
    "TorchAttention",
    "TritonAttention",
    "get_backend_class",
]
