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

A group may span hosts (`tensor_parallel_nodes`, a LeaderWorkerSet's pods): rank 0's
process then opens a `TCPStore` on `tensor_parallel_leader`'s port and puts the config
there; every host runs size / nodes ranks, rank 0's host ranks 0..k-1 and host n, in
`run_node` (`diptych tp-node`), ranks n*k..(n+1)*k-1, which meet rank 0 through that
store. Collectives then go through gloo (on the host's own address) or NCCL, not
through shared memory.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._C._distributed_c10d as c10d

from engine.config import EngineConfig, ModelConfig, leader_address
from engine.parallel import shm_comm
from engine.parallel.group import LOOPBACK, RankLostError, TpGroup
from engine.parallel.shard import TpShard, check_tp

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 300.0  # for every rank to start and reach the store (imports, config)
_STORE, _CONFIG = "store", "config.pkl"
_CONFIG_KEY = "diptych/config"
TCP = "tcp://"  # a store address, where a workdir is otherwise


def _joined(rank: int) -> str:
    return f"diptych/joined/{rank}"


def check_parallel(config: EngineConfig, model: ModelConfig) -> None:
    """Raise ValueError, saying which, for what does not run at this TP size."""
    size = config.tensor_parallel_size
    check_tp(model, size, config.expert_parallel)  # the model's shape
    if config.expert_parallel and not model.num_experts:
        name = model.name or model.architecture
        raise ValueError(f"--expert-parallel-size: {name} has no experts")
    if config.quantization == "gguf":
        raise ValueError(f"--quantization gguf keeps a GGUF file's blocks, which tensor "
                         f"parallelism (size {size}) does not cut; quantize at load instead "
                         "(--quantization int8 or int4: each rank its own shard)")  # fmt: skip
    if config.torch_device().type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"tensor parallel size {size} needs {size} GPUs; "
                         f"{torch.cuda.device_count()} are visible")  # fmt: skip


def comm_bytes(config: EngineConfig, model: ModelConfig) -> int:
    """The largest tensor a step's collectives move: a step's hidden states, or the
    logits' vocabulary slices of a batch, in fp32; with expert parallelism, a sparse
    layer's dispatch (every token's row, router weights and expert ids; the tokens
    rounded up to whole shares; the counts ahead)."""
    size = config.tensor_parallel_size
    shard = TpShard(model, 0, size)
    tokens = config.max_num_batched_tokens
    hidden = tokens * model.hidden_size
    logits = config.max_num_seqs * shard.vocab_rows
    dispatch = 0
    if config.expert_parallel:
        dispatch = (tokens + size) * (model.hidden_size + 2 * model.num_experts_per_tok) + 2 * size
    return 4 * max(hidden, logits, dispatch)


def _group(config: EngineConfig, model: ModelConfig, rank: int, store: c10d.Store, workdir: str
           ) -> TpGroup:  # fmt: skip
    shm: tuple[Path, int] | None = None
    one_host = config.tensor_parallel_nodes == 1
    if one_host and os.environ.get("DIPTYCH_TP_SHM", "1") != "0":  # "0": gloo's (A/B runs)
        path = shm_comm.SHM_DIR / f"diptych-tp-{os.path.basename(workdir)}"
        shm = (path, comm_bytes(config, model))
    shard = TpShard(model, rank, config.tensor_parallel_size, config.expert_parallel)
    return TpGroup(shard, store, config.torch_device(), shm=shm, host=_gloo_host(config),
                   fixed_order=config.deterministic)  # fmt: skip


def _gloo_host(config: EngineConfig) -> str:
    """The address this rank's gloo connections bind: the loopback on one host, else
    `DIPTYCH_TP_HOST` or the host name's address (a pod's IP)."""
    if config.tensor_parallel_nodes == 1:
        return LOOPBACK
    return os.environ.get("DIPTYCH_TP_HOST") or socket.gethostbyname(socket.gethostname())


def _tcp_store(address: str, size: int | None) -> c10d.Store:
    """Rank 0's store listening on `address`'s port (`size` given), or a client of it
    (`None`), which retries until rank 0 listens (hosts start in any order)."""
    host, port = leader_address(address)
    timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    leader = size is not None
    return c10d.TCPStore(host, port, size, leader, timeout, wait_for_workers=False)


def _spawn(where: str, ranks: range) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-m", "engine.parallel.ranks", where, str(r)])
            for r in ranks]  # fmt: skip


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
        """Let the other ranks leave their loop (a `None` plan), then end them (those
        that do not leave in `timeout_s`). Ranks left inside a step rank 0 broke off
        cannot take the plan: they are killed at once."""
        deadline = 0.0 if self.group.broken else time.monotonic() + timeout_s
        try:
            if not self.group.broken and all(p.poll() is None for p in self.procs):
                self.group.broadcast(None, timeout_s=timeout_s)
        except RankLostError:
            deadline = 0.0  # they are not listening: no use waiting
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.group.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_ranks(config: EngineConfig, model: ModelConfig) -> Ranks:
    """Start ranks 1..k-1 of `config.tensor_parallel_size` (k: the ranks a host runs)
    and join every rank, the other hosts' too, as rank 0."""
    size, local = config.tensor_parallel_size, config.ranks_per_node
    workdir = tempfile.mkdtemp(prefix="diptych-tp-")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        store: c10d.Store
        if config.tensor_parallel_nodes > 1:
            store = _tcp_store(config.tensor_parallel_leader, size)
            store.set(_CONFIG_KEY, base64.b64encode(pickle.dumps(config)).decode())
            procs = _spawn(TCP + config.tensor_parallel_leader, range(1, local))
        else:
            with open(os.path.join(workdir, _CONFIG), "wb") as f:
                pickle.dump(config, f)
            store = c10d.FileStore(os.path.join(workdir, _STORE), size)
            procs = _spawn(workdir, range(1, size))
        _wait_for_ranks(store, procs, size)
        group = _group(config, model, 0, store, workdir)
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Ranks(group, procs, workdir)


def _wait_for_ranks(store: c10d.Store, procs: list[subprocess.Popen[bytes]], size: int) -> None:
    """Until every rank (`procs` are this host's 1..k-1) has reached the store; one of
    ours that exits first fails the start."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    keys = [_joined(rank) for rank in range(1, size)]
    while not store.check(keys):
        for rank, p in enumerate(procs, 1):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited ({p.returncode}) "
                                   "before joining; its log says why")  # fmt: skip
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise RuntimeError(f"tensor-parallel ranks did not start in {JOIN_TIMEOUT_S:.0f} s "
                               f"({len(missing)} missing: another host's `diptych tp-node`?)")
        time.sleep(0.05)


def _open(where: str) -> tuple[EngineConfig, c10d.Store, str]:
    """(config, store, workdir) of a rank from rank 0's workdir or `tcp://` address."""
    if where.startswith(TCP):
        store = _tcp_store(where.removeprefix(TCP), None)
        config: EngineConfig = pickle.loads(base64.b64decode(store.get(_CONFIG_KEY)))
        return config, store, tempfile.gettempdir()
    with open(os.path.join(where, _CONFIG), "rb") as f:
        config = pickle.load(f)
    return config, c10d.FileStore(os.path.join(where, _STORE), config.tensor_parallel_size), where


def run_node(leader: str, node: int) -> int:
    """Another host's ranks (`diptych tp-node`): start ranks node*k..(node+1)*k-1 of the
    group whose rank 0 listens on `leader`, and wait for them; the first to fail ends
    the others. Returns the exit code (0 once rank 0 has ended the group)."""
    config, _, _ = _open(TCP + leader)
    nodes = config.tensor_parallel_nodes
    if not 0 < node < nodes:
        raise ValueError(f"node {node} is not one of 1..{nodes - 1} (node 0 is rank 0's)")
    local = config.ranks_per_node
    procs = _spawn(TCP + leader, range(node * local, (node + 1) * local))
    try:
        while True:
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                return max(abs(c or 0) for c in codes)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def run_rank(where: str, rank: int) -> None:
    """A follower: load this rank's shard, then run each step rank 0 sends until it
    sends none (or is gone). `where`: rank 0's workdir, or its store's `tcp://` address."""
    from engine.model_runner import ModelRunner
    from engine.weights import open_checkpoint, resolve_model, weights_for

    config, store, workdir = _open(where)
    checkpoint = open_checkpoint(resolve_model(config.model))
    store.set(_joined(rank), "1")
    device = config.torch_device()
    if device.type == "cuda":  # rank r on its host's (r mod k)-th visible GPU
        torch.cuda.set_device(rank % config.ranks_per_node)
    group = _group(config, checkpoint.config, rank, store, workdir)
    runner = ModelRunner(
        checkpoint.config, config,
        weights_for(checkpoint, config.quantization, group.shard.weights), tp=group,
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
