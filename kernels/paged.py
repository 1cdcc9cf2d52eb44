"""The two arguments every paged-attention kernel takes besides q: the step's batch
(`PagedBatch`, shared by every layer) and one layer's side of it (`PagedLayer`).

    seq_lens:        [S]              tokens with KV in the cache, this step's included
    block_table:     [S, max_blocks]  position p of sequence i sits in block
                                      block_table[i, p // block_size]
    query_start_loc: [S + 1]          sequence i's query tokens are q[qsl[i]:qsl[i + 1]];
                                      None: one query token per sequence (token i is
                                      sequence i), a decode batch

    seq i:   | cached context (seq_len - q_len) | this step's q_len tokens |

`max_query_len` and `max_seq_len` are host-side upper bounds: they size tiles and
KV splits without a device sync. A step builds one `PagedBatch` and every layer
attends with it over its own view of the pool. Index tensors may be int32 or int64
(see `kernels.triton.contract`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor | None = None
    max_query_len: int = 1
    max_seq_len: int | None = None  # None: as many positions as block_table holds

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def seq_len_bound(self, block_size: int) -> int:
        """`max_seq_len`, or the block table's capacity where it was not given."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return int(self.block_table.shape[1]) * block_size


@dataclass(frozen=True)
class PagedLayer:
    """One layer's side of a paged-attention call: its K and V caches (views of the
    pool, [blocks, block_size, kv_heads, head_dim]; int8 / fp8 rows of head_dim + 2,
    `kernels.kv_quant`), its softmax scale and its sliding window (None or 0: none)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float
    window: int | None = None
