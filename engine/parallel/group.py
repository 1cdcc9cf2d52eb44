"""One rank's tensor-parallel group: the collectives its forward pass runs.

A group is its own torch.distributed process group object (`ProcessGroupGloo` on CPU,
`ProcessGroupNCCL` on CUDA), not the process-wide default group: an engine process
may hold a draft model or run tests beside it, and nothing global is set up. The ranks
meet through a `FileStore` in a directory rank 0 creates (engine/parallel/ranks.py), so
no port is opened for the rendezvous; gloo's own connections bind the loopback address
only (the ranks of one worker are processes of one host), unless the group spans hosts
(then rank 0's TCP store, and the host's own address).

The forward pass needs three collectives (engine/models/llama.py): a sum of the
row-parallel partial products after attention and after the MLP (`all_reduce`), and
the vocabulary slices of the logits put side by side (`gather_vocab`); with expert
parallelism a sparse layer sends tokens to their experts' ranks and back
(`all_to_all`) and puts the ranks' shares of the step side by side (`all_gather`). Between CPU
ranks they go through shared memory (shm_comm.py: microseconds where gloo's socket
rounds take a millisecond and more), through gloo or NCCL otherwise. Rank 0, which
schedules, sends every step's plan to the others (`broadcast`), as vLLM's executor
does.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from engine.parallel import shm_comm
from engine.parallel.shard import TpShard
from engine.parallel.shm_comm import RankGone, ShmComm

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
TIMEOUT_S = 600.0  # a collective that waits longer has lost a rank
IDLE_S = 365 * 24 * 3600.0  # how long the other ranks wait for a step (an idle server)


class RankLostError(RuntimeError):
    """A collective failed: a rank of the group is gone (its process died, or it
    stopped answering). The engine cannot run another step."""


class TpGroup:
    """Rank `shard.rank` of `shard.size`, joined to the others through `store` (one
    `FileStore` per process, on a path rank 0 chose)."""

    def __init__(
        self,
        shard: TpShard,
        store: Any,
        device: torch.device,
        timeout_s: float = TIMEOUT_S,
        shm: tuple[Path, int] | None = None,
        host: str = LOOPBACK,
        fixed_order: bool = False,
    ) -> None:
        """`shm`: (a path under /dev/shm, the largest tensor in bytes) for the forward
        pass's collectives through shared memory between CPU ranks (shm_comm.py).
        `host`: the address gloo's connections bind (another host's ranks reach it).
        `fixed_order` (`--deterministic`): every all-reduce sums in rank order."""
        self.shard = shard
        self.device = device
        self.fixed_order = fixed_order
        self.collectives = 0  # the forward passes' all-reduces and gathers so far
        self.collective_s = 0.0  # and the seconds this rank waited on them
        self.collective_bytes = 0  # and the bytes this rank put into them
        self.all_to_all_bytes = 0  # of which the experts' all-to-alls sent to other ranks
        # a step this rank left part way (it raised): the others may wait in its
        # collectives, deaf to anything else until the group's timeout
        self.broken = False
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg: Any
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, shard.rank, shard.size, opts)
        else:
            gloo = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            gloo._timeout = timeout
            self.pg = dist.ProcessGroupGloo(store, shard.rank, shard.size, gloo)
        self.shm: ShmComm | None = None
        if shm is not None and device.type == "cpu" and shm_comm.usable():
            self.shm = self._attach(*shm, timeout_s)

    def _attach(self, path: Path, slot_bytes: int, timeout_s: float) -> ShmComm:
        """Rank 0 creates the segment, every rank maps it, rank 0 unlinks it."""
        if self.rank == 0:
            comm = ShmComm(path, 0, self.size, slot_bytes, timeout_s, create=True)
        self.broadcast("created")
        if self.rank:
            comm = ShmComm(path, self.rank, self.size, slot_bytes, timeout_s, create=False)
        _wait(self.pg.barrier(), "barrier")
        if self.rank == 0:
            comm.unlink()
        return comm

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it. Through shared memory, or with
        `fixed_order`, each element in rank order (`shm_comm.rank_order_sum`, gathered
        first where shared memory cannot take it); else gloo's or NCCL's, whose order
        follows the tensor's size."""
        shm = self.shm
        if shm is not None and t.is_contiguous() and shm.fits(t):
            self._timed(lambda: shm.all_reduce(t), "all-reduce")
        elif self.fixed_order:
            return shm_comm.rank_order_sum(self.all_gather(t), t)
        else:
            self._timed(lambda: _wait(self.pg.allreduce([t]), "all-reduce"), "all-reduce")
        self.collective_bytes += t.numel() * t.element_size()
        return t

    def all_gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `local` (one shape on every rank), in rank order."""
        local = local.contiguous()
        shm = self.shm
        if shm is not None and shm.fits(local):
            parts = self._timed(lambda: shm.all_gather(local), "all-gather")
        else:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            self._timed(lambda: _wait(self.pg.allgather([parts], [local]), "all-gather"),
                        "all-gather")  # fmt: skip
        self.collective_bytes += local.numel() * local.element_size()
        return parts

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary slice [rows, vocab_rows] side by side, the padding
        past the vocabulary cut: [rows, vocab]."""
        return torch.cat(self.all_gather(local), dim=-1)[..., : self.shard.model.vocab_size]

    def all_to_all(
        self, rows: torch.Tensor, splits: list[int], most: int
    ) -> tuple[torch.Tensor, list[int]]:
        """Send rows [P, ...] in rank order, `splits[r]` of them to rank r: (the rows each
        rank sent this one, in rank order; how many came from each). Rows go as bytes
        (any dtype, one shape); the counts are exchanged first where the group has no
        shared memory (gloo, NCCL). `most`: the most rows any rank sends in this round,
        the same on every rank (so that all take the same way)."""
        shape, dtype = rows.shape[1:], rows.dtype
        data = rows.contiguous().reshape(rows.shape[0], math.prod(shape)).view(torch.uint8)
        width = data.shape[1]
        shm = self.shm
        if shm is not None and shm.fits(data[:0], extra=8 * self.size + most * width):
            flat = data.reshape(-1)
            parts = self._timed(
                lambda: shm.all_to_all(flat, [n * width for n in splits]), "all-to-all"
            )
            got = [p.numel() // width for p in parts]
            recv = torch.cat(parts).view(sum(got), width)
        else:
            send = torch.tensor(splits, dtype=torch.int64, device=self.device)
            counts = torch.empty_like(send)
            ones = [1] * self.size
            self._timed(lambda: _wait(self.pg.alltoall_base(counts, send, ones, ones),
                                      "all-to-all"), "all-to-all")  # fmt: skip
            got = counts.tolist()
            recv = data.new_empty(sum(got), width)
            self._timed(lambda: _wait(self.pg.alltoall_base(recv, data, got, splits),
                                      "all-to-all"), "all-to-all")  # fmt: skip
        sent = (sum(splits) - splits[self.rank]) * width
        self.collective_bytes += sent
        self.all_to_all_bytes += sent
        return recv.view(dtype).view(recv.shape[0], *shape), got

    def _timed(self, run: Callable[[], T], what: str) -> T:
        """Run a forward pass's collective, counting it and its time (what the split
        costs a step: the benchmarks read these)."""
        began = time.perf_counter()
        try:
            out = run()
        except RankGone as e:
            raise RankLostError(f"tensor-parallel {what} failed, a rank is gone: {e}") from e
        self.collectives += 1
        self.collective_s += time.perf_counter() - began
        return out

    def broadcast(self, obj: object = None, idle: bool = False, timeout_s: float | None = None
                  ) -> Any:  # fmt: skip
        """Rank 0's `obj`, on every rank (the others pass nothing). `idle`: the others
        wait as long as rank 0 takes (the next step of a server may be hours away); a
        rank that dies still ends the wait at once (its connections close). `timeout_s`:
        wait at most this long (else the group's timeout)."""
        if self.rank == 0:
            data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
            size = torch.tensor([data.size], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size, IDLE_S if idle else timeout_s)
        payload = torch.from_numpy(data.copy()) if self.rank == 0 else torch.empty(
            int(size.item()), dtype=torch.uint8
        )  # fmt: skip
        self._broadcast(payload, timeout_s)
        if self.rank == 0:
            return obj
        return pickle.loads(payload.cpu().numpy().tobytes())

    def _broadcast(self, t: torch.Tensor, timeout_s: float | None = None) -> None:
        on = t.to(self.device)  # NCCL moves device tensors only
        if timeout_s is None:
            work = self.pg.broadcast(on, 0)
        else:
            work = self.pg.broadcast(on, 0, datetime.timedelta(seconds=timeout_s))
        _wait(work, "broadcast")
        if on is not t:
            t.copy_(on.cpu())

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(RuntimeError):  # a peer already gone
                shutdown()


def _wait(work: Any, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:  # torch's DistBackendError and gloo's errors
        raise RankLostError(f"tensor-parallel {what} failed, a rank is gone: {e}") from e
