"""Attention through the unified paged-attention kernel: the whole ragged batch
(decodes, fresh prompts, chunks after a cached prefix) in one launch per layer.

`prepare` moves the step's index arrays to the device once for all layers: slot
mapping int64 (as `BatchLayout` builds it), query start offsets and sequence lengths
int32, the block table int32 trimmed to the longest sequence's blocks. The kernels
take either index width (see `kernels.triton.contract`); int32 halves the bytes.
On CUDA the backend's `Kernels` run the Triton kernels; with the kernels forced to
Triton and TRITON_INTERPRET=1 the same path runs on CPU tensors, which is how the tests
drive it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.backend import AttentionBackend, BatchLayout, RowsMetadata
from kernels.paged import PagedBatch, PagedLayer


@dataclass
class TritonAttentionMetadata:
    slots: torch.Tensor  # int64 [T], -1 for padding
    batch: PagedBatch  # int32 offsets, lengths and table (blocks of the longest sequence)


class TritonAttention(AttentionBackend):
    name = "triton"

    def prepare(self, batch: BatchLayout) -> TritonAttentionMetadata | RowsMetadata:
        if self.deterministic:
            return self.prepare_rows(batch, table_per_token=True)
        dev = batch.device
        max_seq_len = int(batch.seq_lens.max()) if batch.num_seqs else 0
        nb = max(1, -(-max_seq_len // batch.block_size))
        table = np.ascontiguousarray(batch.block_table[:, :nb])
        return TritonAttentionMetadata(
            slots=torch.from_numpy(batch.slot_mapping).to(dev),
            batch=PagedBatch(
                seq_lens=torch.from_numpy(batch.seq_lens.astype(np.int32)).to(dev),
                block_table=torch.from_numpy(table).to(dev),
                query_start_loc=torch.from_numpy(batch.query_start_loc.astype(np.int32)).to(dev),
                max_query_len=int(batch.query_lens.max()) if batch.num_seqs else 0,
                max_seq_len=max_seq_len,
            ),
        )

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: PagedLayer,
        meta: TritonAttentionMetadata,
    ) -> torch.Tensor:  # fmt: skip
        return self.kernels.unified_attention(q, layer, meta.batch)
