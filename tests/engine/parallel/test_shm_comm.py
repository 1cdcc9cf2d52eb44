"""The shared-memory collectives of CPU ranks (engine/parallel/shm_comm.py): every rank
gets the same sum, bit for bit, in fp32 and bf16, round after round (the two buffers
reused); the gather returns every rank's tensor in rank order; a rank that dies ends
the others' wait with an error instead of a hang; the segment's file is gone once all
ranks have mapped it."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.parallel import shm_comm
from engine.parallel.shm_comm import RankGone, ShmComm

pytestmark = pytest.mark.skipif(not shm_comm.usable(), reason="x86-64 with /dev/shm only")

SIZE, ROUNDS = 3, 40


def _rank(rank: int, path: str, out: Any, attached: Any, die_at: int | None) -> None:
    torch.set_num_threads(1)
    comm = ShmComm(Path(path), rank, SIZE, 4 * 64 * 48, 30.0, create=False)
    attached.wait()
    sums, gathers = [], []
    for i in range(ROUNDS):
        if die_at is not None and rank == SIZE - 1 and i == die_at:
            os._exit(3)
        g = torch.Generator().manual_seed(1000 * i + rank)
        dtype = torch.bfloat16 if i % 2 else torch.float32
        t = torch.randn(64, 48, generator=g).to(dtype)
        mine = t[:2].clone()
        try:
            sums.append(comm.all_reduce(t).float().clone())  # (in place)
            gathers.append(torch.stack(comm.all_gather(mine)).float())
        except RankGone as e:
            out.put((rank, "gone", str(e)))
            return
    # numpy, not tensors: torch would share a tensor's memory with the reader by a file
    # descriptor this process takes with it when it exits
    out.put((rank, torch.stack(sums).numpy(), torch.stack(gathers).numpy()))


def _run(tmp: str, die_at: int | None = None) -> list[tuple[Any, ...]]:
    path = shm_comm.SHM_DIR / f"diptych-test-{os.getpid()}-{time.monotonic_ns()}"
    first = ShmComm(path, 0, SIZE, 4 * 64 * 48, 30.0, create=True)  # rank 0's role: create
    first.close()
    ctx = mp.get_context("spawn")
    out, attached = ctx.Queue(), ctx.Barrier(SIZE + 1)
    procs = [ctx.Process(target=_rank, args=(r, str(path), out, attached, die_at))
             for r in range(SIZE)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        attached.wait(timeout=120)
        path.unlink()  # as rank 0 does once every rank has mapped it
        results = [out.get(timeout=120) for _ in range(SIZE - (die_at is not None))]
    finally:
        for p in procs:
            p.join(30)
        if path.exists():
            path.unlink()
    assert not path.exists()
    return sorted(results, key=lambda r: r[0])


def test_every_rank_gets_the_same_sum_and_gather(tmp_path: Path) -> None:
    results = _run(str(tmp_path))
    results = [(r[0], torch.from_numpy(r[1]), torch.from_numpy(r[2])) for r in results]
    sums = [r[1] for r in results]
    assert all(torch.equal(sums[0], s) for s in sums[1:])  # the same bits on every rank
    for i in range(ROUNDS):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        parts = [torch.randn(64, 48, generator=torch.Generator().manual_seed(1000 * i + r))
                 .to(dtype).float() for r in range(SIZE)]  # fmt: skip
        want = parts[0] + parts[1] + parts[2]
        tol = 2e-2 if i % 2 else 1e-6
        assert torch.allclose(sums[0][i], want.to(dtype).float(), atol=tol, rtol=tol), i
        assert torch.equal(results[1][2][i], torch.stack([p[:2] for p in parts])), i


def test_a_rank_that_dies_ends_the_wait(tmp_path: Path) -> None:
    results = _run(str(tmp_path), die_at=7)
    assert [r[1] for r in results] == ["gone", "gone"]
    assert all(f"rank {SIZE - 1}" in r[2] for r in results)
