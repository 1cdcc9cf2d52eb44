"""Attention over the paged KV cache: the step layout and the backends."""

from engine.attention.backend import AttentionBackend, get_backend_class
from engine.attention.batch import BatchLayout
from engine.attention.torch_backend import TorchAttention

__all__ = ["AttentionBackend", "BatchLayout", "TorchAttention", "get_backend_class"]
