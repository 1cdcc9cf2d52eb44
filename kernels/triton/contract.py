"""Host-side checks every Triton launcher runs before it launches.

Index dtype contract: block tables, slot mappings, block ids, sequence lengths and
query start offsets may each be int32 or int64, independently of one another. A
kernel reads an index tensor through a pointer typed by that tensor's dtype (Triton
specializes the kernel on it), so one width is never read as the other, and it
widens every index to int64 before multiplying by a stride, so pools larger than
2**31 elements address correctly. Any other dtype (int16, uint8, bool, floats) is
rejected with a TypeError naming the argument. Index tensors must live on the
device of the data they index.
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
# dtypes the arithmetic kernels take; copies (store_kv, block copies) move any 1-, 2-,
# 4- or 8-byte dtype bit for bit.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def index_tensor(name: str, t: torch.Tensor, device: torch.device, ndim: int) -> torch.Tensor:
    """Validate an index tensor; returns it with a unit stride on its last dim."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 or int64, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the data it indexes on {device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def float_tensor(name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Arithmetic kernels take fp32/fp16/bf16 with a unit stride on the last dim."""
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} is {t.dtype}, expected {dtype}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a unit stride on its last dim, got {t.stride()}")


def as_words(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret a tensor as signed integers of the same width: copy kernels then
    move bits, whatever the float format (and bf16 works in the interpreter too)."""
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = t.element_size()
    if size not in words:
        raise TypeError(f"cannot copy elements of {size} bytes ({t.dtype})")
    return t if t.dtype == words[size] else t.view(words[size])


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
