"""Prompt-lookup drafting: continue the context the way it continued before.

The longest suffix of the context (up to `max_n` tokens, at least `min_n`) that also
occurred earlier is looked up; the tokens that followed its most recent earlier
occurrence are the draft. Edits of code or text being quoted back repeat long runs
of the prompt, which this proposes for the price of a search over the token ids.

    context:  ... a b c d e ... x a b c       suffix "a b c" (n = 3) occurred earlier
    draft:                    d e ...         the k tokens that followed it
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(
    tokens: Sequence[int] | np.ndarray, k: int, min_n: int = 1, max_n: int = 4
) -> list[int]:
    """Up to `k` draft tokens for the context `tokens` (prompt and output so far), or
    [] when no suffix of `min_n`..`max_n` tokens occurred earlier."""
    if k <= 0 or min_n < 1 or max_n < min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # earlier windows start at 0..size-n-1 (the suffix itself starts at size-n)
        windows = sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the most recent occurrence's continuation
            draft: list[int] = arr[start : start + k].tolist()
            return draft
    return []
