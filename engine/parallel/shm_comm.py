"""All-reduce, all-gather and all-to-all between the CPU ranks of one host, through shared memory.

Gloo's all-reduce between two processes of one host costs about a millisecond and a
half on the development machine, whatever the size (a ring of socket round trips); a
decode step runs two a layer. Here each rank copies its tensor into its own slot of a
shared segment, publishes the round's number, waits for every rank's number and sums
the slots itself, in rank order, so every rank computes the same bits. A round is a
copy in, a few microseconds of waiting when the ranks are in step, and a sum.

    segment: | round published, per rank (int64) | pid, per rank (int64) |
             | buffer 0: one slot per rank | buffer 1: one slot per rank |

Round r uses buffer r % 2. A rank writes round r + 2's data into a buffer only after
every rank has published round r + 1, which each does only after it finished reading
round r: two buffers are enough. The stores are ordered by the x86 memory model
(stores are seen in program order, loads are not reordered with older loads), so this
runs on x86-64 only; elsewhere the group keeps gloo.

A rank that waits checks now and then that the ranks it waits for still run; one
that died (or a wait past the timeout) is `RankLostError`. The segment is a file under
/dev/shm that rank 0 creates and unlinks as soon as every rank has mapped it, so no
crash leaves it behind.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
HEADER = 4096  # two int64 arrays of up to 256 ranks each
SPIN, YIELD_S = 2000, 0.002  # busy checks, then yields for this long, then short sleeps
CHECK_S = 0.5  # how often a long wait looks at the other ranks' processes


# partial sums added in a wider type and rounded once: every rank's sum is the same
# bits whatever the rank count, and as close to the exact sum as one rounding allows
_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def rank_order_sum(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """The ranks' `parts` (two or more) summed element by element in rank order, in a
    wider type, into `out`: each element's sum depends on its own values alone, never
    on the tensor's size (a ring all-reduce cuts the tensor by its size)."""
    wide = _WIDER.get(out.dtype)
    if wide is None:
        torch.add(parts[0], parts[1], out=out)
        for s in parts[2:]:
            out += s
        return out
    acc = parts[0].to(wide)
    for s in parts[1:]:
        acc += s
    return out.copy_(acc)


class RankGone(RuntimeError):
    """A rank this one waits for has died, or did not arrive in time."""


def usable() -> bool:
    """Whether this host can run it: x86-64 (its memory model) with a /dev/shm."""
    return platform.machine() in ("x86_64", "AMD64") and SHM_DIR.is_dir()


class ShmComm:
    """Rank `rank` of `size` on segment `path`, slots of `slot_bytes`. Rank 0 creates
    the file (`create`), the others open it; `unlink` once all have."""

    def __init__(
        self, path: Path, rank: int, size: int, slot_bytes: int, timeout_s: float, create: bool
    ) -> None:
        if size > HEADER // 16:
            raise ValueError(f"at most {HEADER // 16} ranks share a segment")
        self.path, self.rank, self.size = path, rank, size
        self.slot_bytes = -(-slot_bytes // 64) * 64
        self.timeout_s = timeout_s
        total = HEADER + 2 * size * self.slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, total)
            self._map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self._rounds = np.frombuffer(self._map, dtype=np.int64, count=size)
        self._pids = np.frombuffer(self._map, dtype=np.int64, count=size, offset=8 * size)
        self._pids[rank] = os.getpid()
        self.round = 0

    def unlink(self) -> None:
        """Remove the file (the mappings stay): rank 0, once every rank has opened it."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def fits(self, t: torch.Tensor, extra: int = 0) -> bool:
        """Whether `t` (and `extra` bytes beside it) fits a slot."""
        return t.device.type == "cpu" and t.numel() * t.element_size() + extra <= self.slot_bytes

    def _slot(self, buffer: int, rank: int, t: torch.Tensor) -> torch.Tensor:
        """Rank `rank`'s slot of `buffer` as a tensor shaped and typed like `t`."""
        start = HEADER + (buffer * self.size + rank) * self.slot_bytes
        raw = self._buf[start : start + t.numel() * t.element_size()]
        return torch.from_numpy(raw).view(t.dtype).view(t.shape)

    def _publish(self, t: torch.Tensor) -> int:
        self.round += 1
        buffer = self.round % 2
        self._slot(buffer, self.rank, t).copy_(t)
        self._rounds[self.rank] = self.round  # after the data: x86 keeps the order
        self._wait(self.round)
        return buffer

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks into `t` (in rank order, in a wider type)."""
        buffer = self._publish(t)
        return rank_order_sum([self._slot(buffer, r, t) for r in range(self.size)], t)

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t`, in rank order (copies: the slots are reused)."""
        buffer = self._publish(t)
        return [self._slot(buffer, r, t).clone() for r in range(self.size)]

    def all_to_all(self, data: torch.Tensor, splits: list[int]) -> list[torch.Tensor]:
        """Bytes `data` (uint8, 1-D) cut into `splits[r]` bytes for rank r, in rank
        order: the bytes each rank cut for this one, in rank order (copies). A slot holds
        the rank's splits, then its data."""
        head = torch.tensor(splits, dtype=torch.int64).view(torch.uint8)
        buffer = self._publish(torch.cat([head, data]))
        parts = []
        for r in range(self.size):
            start = HEADER + (buffer * self.size + r) * self.slot_bytes
            theirs = self._buf[start : start + 8 * self.size].view(np.int64)
            begin = start + 8 * self.size + int(theirs[: self.rank].sum())
            parts.append(torch.from_numpy(self._buf[begin : begin + int(theirs[self.rank])].copy()))
        return parts

    def _wait(self, round_: int) -> None:
        rounds = self._rounds
        if rounds.min() >= round_:
            return
        for _ in range(SPIN):
            if rounds.min() >= round_:
                return
        began = time.monotonic()
        checked = began
        while rounds.min() < round_:
            now = time.monotonic()
            if now - began < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(20e-6)
            if now - checked > CHECK_S:
                checked = now
                self._check_ranks(round_)
                if now - began > self.timeout_s:
                    raise RankGone(f"waited {self.timeout_s:.0f} s for round {round_}")

    def _check_ranks(self, round_: int) -> None:
        for r in range(self.size):
            if self._rounds[r] < round_ and not _alive(int(self._pids[r])):
                raise RankGone(f"rank {r} (pid {int(self._pids[r])}) is gone")

    def close(self) -> None:
        del self._rounds, self._pids, self._buf  # the views first
        with contextlib.suppress(BufferError):  # a tensor still views it: it goes with that
            self._map.close()


def _alive(pid: int) -> bool:
    """A process that runs (not a zombie its parent has yet to reap)."""
    if pid <= 0:
        return True  # not attached yet: the timeout decides
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")
