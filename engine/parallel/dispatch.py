"""Expert parallelism's token traffic: each rank's share of a step's tokens sent to the
ranks that hold their experts, and the experts' outputs sent back, by all-to-all.

With `--expert-parallel-size N` (the tensor-parallel size) rank r holds experts
r·E/N .. (r+1)·E/N - 1 whole (engine/parallel/shard.py). The hidden states entering a
sparse layer are the same on every rank (attention's all-reduce put them there), and
every rank routes all of them alike (the router is small, and every rank then counts
the same expert load). The step's T tokens are cut into N contiguous shares, and rank r,
for its share:

1. sends each token once to each rank that holds any of its k experts: its hidden row,
   its k expert ids and router weights (the first all-to-all; a receiver leaves out the
   ids of experts it does not hold);
2. receives the rows the other ranks sent it and runs them through its own experts
   (`kernels.moe.grouped_experts`: a row's experts here weighted and summed);
3. sends each result back to the rank it came from (the second all-to-all, the counts
   reversed), and adds up the rows that came back for each of its tokens, and the shared
   experts' output (held whole on every rank) for its share;
4. puts the shares side by side on every rank (an all-gather): the next layer's input.

What crosses between ranks a step: per sparse layer, a share's rows once per other rank
its tokens' experts are on, there and back, and the all-gather; `TpGroup.all_to_all_bytes`
counts the all-to-alls, and the engine exports them a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.parallel.group import TpGroup

# (rows [P, H], router weights [P, k] fp32, expert ids [P, k]) -> [P, H]: a rank's experts
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def owners(
    ids: torch.Tensor, experts_per_rank: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination rank, token) of every (token, rank) pair where the rank holds at
    least one of the token's experts, sorted by rank and then token."""
    owner = torch.div(ids, experts_per_rank, rounding_mode="floor")
    hit = torch.zeros(ids.shape[0], size, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, owner, True)
    dest, token = hit.T.nonzero(as_tuple=True)
    return dest, token


def dispatch_combine(
    group: TpGroup,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts_per_rank: int,
    experts: Experts,
    shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """[T, H] on every rank: every token's routed experts (and the shared ones), summed.
    `x` [T, H], `weights` / `ids` [T, k]: the whole step's, the same on every rank."""
    n, rank = group.size, group.rank
    t, h = x.shape
    per = -(-t // n)  # contiguous shares, the last ones shorter or empty
    lo, hi = min(rank * per, t), min((rank + 1) * per, t)
    mine, w, e = x[lo:hi], weights[lo:hi].float(), ids[lo:hi]
    dest, token = owners(e, experts_per_rank, n)
    splits = torch.bincount(dest, minlength=n).tolist()
    sent = _pack(mine[token], w[token], e[token].to(torch.int32))
    most = per * n  # a share's tokens each to every rank; as many back
    got, counts = group.all_to_all(sent, splits, most)
    rows, rw, rid = _unpack(got, x.dtype, h, e.shape[1])
    out = experts(rows, rw, rid.long()) if rows.shape[0] else rows
    back, _ = group.all_to_all(out, counts, most)
    wide = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    acc = torch.zeros(hi - lo, h, dtype=wide, device=x.device)
    acc.index_add_(0, token, back.to(wide))
    if shared is not None and hi > lo:
        acc += shared(mine)
    padded = x.new_zeros(per, h)
    padded[: hi - lo] = acc.to(x.dtype)
    return torch.cat(group.all_gather(padded))[:t]


def _pack(*parts: torch.Tensor) -> torch.Tensor:
    """Rows of several tensors (one row count, any dtypes) as one uint8 row each."""
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)


def _unpack(
    data: torch.Tensor, dtype: torch.dtype, h: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_pack`'s (hidden rows [P, h] of `dtype`, weights [P, k] fp32, ids [P, k] int32)."""
    cut = h * dtype.itemsize
    rows = data[:, :cut].contiguous().view(dtype)
    rw = data[:, cut : cut + 4 * k].contiguous().view(torch.float32)
    rid = data[:, cut + 4 * k :].contiguous().view(torch.int32)
    return rows, rw, rid
