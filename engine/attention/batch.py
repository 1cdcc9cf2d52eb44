"""The shape of one forward step, as every attention backend sees it.

Tokens of all scheduled sequences are flattened into one ragged batch:

    tokens:           | seq 0 (q_len 1) | seq 1 (q_len 1) | seq 2 (q_len 5)      |
    query_start_loc:  0                 1                 2                      7
    seq_lens:         = tokens with KV after this step (cached prefix + new tokens)
    positions:        seq_len - q_len ... seq_len - 1, per sequence
    slot_mapping:     block_table[pos // block_size] * block_size + pos % block_size

Sequences with q_len == 1 (decodes) come first, so backends can batch them.
`block_table` rows are padded with block 0, the null block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


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
