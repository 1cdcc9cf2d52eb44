"""The processes of a tensor-parallel engine.

Rank 0 is the engine's own process: it schedules, builds each step's plan and samples.
Ranks 1..N-1 are child processes (`python -m engine.parallel.ranks`), one per rank,
each loading its shard of the same checkpoint and running every step's forward pass on
the plan rank 0 broadcasts (`ModelRunner.forward`); they hold their own KV heads of
every block. They meet rank 0 through a `FileStore` in a private temporary directory
(no port is opened for that), and the group's connections bind the loopback address.

A rank that dies ends the others' next collective at once (its connections close):
rank 0's step then raises `RankLostError` and the engine stops (the worker leaves
discovery and exits, its requests move as for any dead worker); a follower whose
rank 0 died leaves its loop the same way and exits.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._C._distributed_c10d as c10d

from engine.config import EngineConfig, ModelConfig
from engine.parallel import shm_comm
from engine.parallel.group import RankLostError, TpGroup
from engine.parallel.shard import TpShard, check_tp

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # for every rank to start and reach the store (imports, config)
_STORE, _CONFIG = "store", "config.pkl"


def _joined(rank: int) -> str:
    return f"diptych/joined/{rank}"


def check_parallel(config: EngineConfig, model: ModelConfig) -> None:
    """Raise ValueError, saying which, for what does not run at this TP size."""
    size = config.tensor_parallel_size
    check_tp(model, size)  # the model's shape
    if config.quantization is not None:
        raise ValueError(f"--quantization {config.quantization} keeps weights quantized, "
                         f"which tensor parallelism (size {size}) does not split yet; "
                         "run dense weights (leave --quantization out)")  # fmt: skip
    if config.num_speculative_tokens or config.speculative_model:
        raise ValueError(f"speculative decoding does not run at tensor parallel size "
                         f"{size} yet; leave --num-speculative-tokens and "
                         "--speculative-model out")  # fmt: skip
    if config.torch_device().type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor parallel size {size} needs {size} GPUs; "
                         f"{torch.cuda.device_count()} are visible")  # fmt: skip


def comm_bytes(config: EngineConfig, model: ModelConfig) -> int:
    """The largest tensor a step's collectives move: a step's hidden states, or the
    logits' vocabulary slices of a batch, in fp32."""
    shard = TpShard(model, 0, config.tensor_parallel_size)
    hidden = config.max_num_batched_tokens * model.hidden_size
    logits = config.max_num_seqs * shard.vocab_rows
    return 4 * max(hidden, logits)


def _group(config: EngineConfig, model: ModelConfig, rank: int, store: c10d.Store, workdir: str
           ) -> TpGroup:  # fmt: skip
    shm: tuple[Path, int] | None = None
    if os.environ.get("DIPTYCH_TP_SHM", "1") != "0":  # "0": gloo's (A/B measurements)
        path = shm_comm.SHM_DIR / f"diptych-tp-{os.path.basename(workdir)}"
        shm = (path, comm_bytes(config, model))
    shard = TpShard(model, rank, config.tensor_parallel_size)
    return TpGroup(shard, store, config.torch_device(), shm=shm)


def rank_config(config: EngineConfig) -> EngineConfig:
    """`config` as each rank runs it: on CPU without a thread count, the cores shared
    out among the ranks (each would otherwise start one thread per core)."""
    if config.threads is not None or config.torch_device().type != "cpu":
        return config
    threads = max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
    return dataclasses.replace(config, threads=threads)


@dataclass(eq=False)
class Ranks:
    """Rank 0's hold on the group and the other ranks' processes."""

    group: TpGroup
    procs: list[subprocess.Popen[bytes]]
    workdir: str

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the other ranks leave their loop (a `None` plan), then end them."""
        try:
            if all(p.poll() is None for p in self.procs):
                self.group.broadcast(None)
        except RankLostError:
            pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.group.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_ranks(config: EngineConfig, model: ModelConfig) -> Ranks:
    """Start ranks 1..N-1 of `config.tensor_parallel_size` and join them as rank 0."""
    size = config.tensor_parallel_size
    workdir = tempfile.mkdtemp(prefix="diptych-tp-")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(os.path.join(workdir, _CONFIG), "wb") as f:
            pickle.dump(config, f)
        store = c10d.FileStore(os.path.join(workdir, _STORE), size)
        for rank in range(1, size):
            cmd = [sys.executable, "-m", "engine.parallel.ranks", workdir, str(rank)]
            procs.append(subprocess.Popen(cmd))
        _wait_for_ranks(store, procs)
        group = _group(config, model, 0, store, workdir)
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Ranks(group, procs, workdir)


def _wait_for_ranks(store: c10d.Store, procs: list[subprocess.Popen[bytes]]) -> None:
    """Until every rank has reached the store; a rank that exits first fails the start."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    keys = [_joined(rank) for rank in range(1, len(procs) + 1)]
    while not store.check(keys):
        for rank, p in enumerate(procs, 1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited ({p.returncode}) "
                                   "before joining; its log says why")  # fmt: skip
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not start in {JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def run_rank(workdir: str, rank: int) -> None:
    """A follower: load this rank's shard, then run each step rank 0 sends until it
    sends none (or is gone)."""
    from engine.model_runner import ModelRunner
    from engine.weights import open_checkpoint, resolve_model, weights_for

    with open(os.path.join(workdir, _CONFIG), "rb") as f:
        config: EngineConfig = pickle.load(f)
    size = config.tensor_parallel_size
    checkpoint = open_checkpoint(resolve_model(config.model))
    store = c10d.FileStore(os.path.join(workdir, _STORE), size)
    store.set(_joined(rank), "1")
    device = config.torch_device()
    if device.type == "cuda":
        torch.cuda.set_device(rank)  # rank r on the r-th visible GPU (rank 0 on the first)
    group = _group(config, checkpoint.config, rank, store, workdir)
    runner = ModelRunner(
        checkpoint.config, config, weights_for(checkpoint, config.quantization), tp=group
    )
    try:
        while (plan := group.broadcast(idle=True)) is not None:
            runner.forward(plan)
    except RankLostError as e:
        log.error("tensor-parallel rank %d stops: %s", rank, e)
        raise SystemExit(1) from None
    finally:
        group.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_grad_enabled(False)
    run_rank(sys.argv[1], int(sys.argv[2]))
