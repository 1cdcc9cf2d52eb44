"""Move whole KV blocks (every layer's K and V) between the pool and a staging buffer,
or between blocks of the pool.

    pool:    [num_blocks, *block_shape]   each block one contiguous byte range
    staging: [n, *block_shape]            contiguous, same dtype

One kernel serves three launchers: `gather_blocks` packs pool[ids[i]] into staging[i]
(for transfer backends that send from a staging buffer), `scatter_blocks` unpacks
staging[i] into pool[ids[i]], `copy_blocks` copies pool[src[i]] to pool[dst[i]]
(copy-on-write). A negative id skips its row. Ids are not bounds-checked on the
device (that would cost a sync): they must be below num_blocks, as the block
manager guarantees. Blocks are moved as 32-bit words when their byte size allows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.contract import as_words, index_tensor
from kernels.triton.jit import kernel

CHUNK = 4096  # words per program


@kernel
def copy_blocks_kernel(
    src_ptr: tl.tensor,
    dst_ptr: tl.tensor,
    src_ids_ptr: tl.tensor,
    dst_ids_ptr: tl.tensor,
    src_stride: tl.tensor,
    dst_stride: tl.tensor,
    words: tl.tensor,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    CHUNK: tl.constexpr,
) -> None:
    i = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    if SRC_INDEXED:
        src = tl.load(src_ids_ptr + i).to(tl.int64)
    else:
        src = i
    if DST_INDEXED:
        dst = tl.load(dst_ids_ptr + i).to(tl.int64)
    else:
        dst = i
    # negative ids skip the row (broadcast first: the interpreter mis-types scalar & tensor)
    mask = (offs < words) & (offs * 0 + tl.minimum(src, dst) >= 0)
    x = tl.load(src_ptr + src * src_stride + offs, mask=mask)
    tl.store(dst_ptr + dst * dst_stride + offs, x, mask=mask)


def _block_words(pool: torch.Tensor, name: str) -> torch.Tensor:
    """[num_blocks, words] view of a block-major tensor, as 32-bit words if possible."""
    if pool.dim() < 2:
        raise ValueError(f"{name} must be [num_blocks, ...], got shape {tuple(pool.shape)}")
    if not pool[0].is_contiguous():
        raise ValueError(
            f"{name}: each block must be one contiguous range, strides {pool.stride()}"
        )
    flat = pool.view(pool.shape[0], -1) if pool.shape[0] else pool.reshape(0, -1)
    if pool.shape[0] > 1 and flat.stride(0) < flat.shape[1]:
        raise ValueError(f"{name}: blocks overlap (strides {pool.stride()})")
    as_bytes = as_words(flat).view(torch.uint8)
    nbytes = flat.shape[1] * flat.element_size()
    stride_bytes = flat.stride(0) * flat.element_size()
    if nbytes % 4 == 0 and stride_bytes % 4 == 0 and as_bytes.data_ptr() % 4 == 0:
        return as_bytes.view(torch.int32)
    return as_words(flat)


def _launch(
    src: torch.Tensor,
    dst: torch.Tensor,
    n: int,
    src_ids: torch.Tensor | None,
    dst_ids: torch.Tensor | None,
) -> None:
    if n == 0:
        return
    s, d = _block_words(src, "source"), _block_words(dst, "destination")
    if s.dtype != d.dtype or s.shape[1] != d.shape[1]:
        raise ValueError("source and destination blocks differ in size or dtype")
    dummy = src_ids if src_ids is not None else dst_ids
    copy_blocks_kernel[(n, triton.cdiv(s.shape[1], CHUNK))](
        s,
        d,
        src_ids if src_ids is not None else dummy,
        dst_ids if dst_ids is not None else dummy,
        s.stride(0),
        d.stride(0),
        s.shape[1],
        SRC_INDEXED=src_ids is not None,
        DST_INDEXED=dst_ids is not None,
        CHUNK=CHUNK,
    )


def _check_pair(pool: torch.Tensor, buf: torch.Tensor, n: int) -> None:
    if buf.dtype != pool.dtype or tuple(buf.shape[1:]) != tuple(pool.shape[1:]):
        raise ValueError(
            f"staging buffer {tuple(buf.shape)} {buf.dtype} does not hold blocks of "
            f"pool {tuple(pool.shape)} {pool.dtype}"
        )
    if buf.shape[0] < n:
        raise ValueError(f"staging buffer holds {buf.shape[0]} blocks, {n} requested")
    if buf.device != pool.device:
        raise ValueError(f"staging buffer on {buf.device}, pool on {pool.device}")


def gather_blocks(
    pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    ids = index_tensor("block_ids", block_ids, pool.device, 1)
    if out is None:
        out = torch.empty((ids.shape[0], *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    _check_pair(pool, out, ids.shape[0])
    _launch(pool, out, ids.shape[0], ids, None)
    return out


def scatter_blocks(src: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    ids = index_tensor("block_ids", block_ids, pool.device, 1)
    _check_pair(pool, src, ids.shape[0])
    _launch(src, pool, ids.shape[0], None, ids)


def copy_blocks(pool: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    src = index_tensor("src_ids", src_ids, pool.device, 1)
    dst = index_tensor("dst_ids", dst_ids, pool.device, 1)
    if src.shape != dst.shape:
        raise ValueError(f"src_ids {tuple(src.shape)} and dst_ids {tuple(dst.shape)} differ")
    _launch(pool, pool, src.shape[0], src, dst)
