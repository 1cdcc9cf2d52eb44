"""KV tiers under the paged cache (engine/kv_cache/tiers.py), on a tiny Llama in fp32
with a device pool too small to keep a session's prefix: evicted blocks go to the host
tier and on to disk, a later request restores them instead of computing them, and its
greedy tokens are the ones an engine without tiers gives. The disk tier survives a
restart; a corrupt file, or another layout, is computed again, never served."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from tests.conftest import REPORT
from tests.engine.test_models_safetensors import _write

MiB = 1 << 20
NEW = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, path = _write(tmp_path_factory.mktemp("tiers"), "llama", sharded=False)
    return Path(path)


def _prompts() -> list[list[int]]:
    """A session's prompt (four whole blocks and a few tokens) and three others that
    take the pool's blocks over."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 250, (70,), generator=g).tolist() for _ in range(4)]


def _engine(model: Path, **kw: Any) -> EngineCore:
    # 11 usable blocks of 16 tokens: one request's 5 blocks at a time, and no more than
    # two requests' prefixes stay cached
    return EngineCore(EngineConfig(model=str(model), dtype="float32", num_blocks=12,
                                   max_num_seqs=1, **kw))  # fmt: skip


def _run(
    core: EngineCore, rid: str, prompt: list[int], session: str | None = None
) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens found cached) of one request run alone (a turn of
    `session`: its blocks may stay held after it)."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    core.submit(NewRequest(rid, prompt, params, session_id=session))
    tokens: list[int] = []
    cached = 0
    while core.has_unfinished_requests():
        for o in core.step():
            tokens += o.new_token_ids
            cached = o.num_cached_tokens
    assert not core.check_invariants()
    assert core.is_idle() or core.snapshot().sessions_held
    return tokens, cached


def _session(core: EngineCore, tag: str) -> list[tuple[list[int], int]]:
    """The session's prompt, the three others (evicting it from the device pool), then
    the session's prompt again."""
    session, *others = _prompts()
    out = [_run(core, f"{tag}-first", session)]
    out += [_run(core, f"{tag}-other{i}", p) for i, p in enumerate(others)]
    out.append(_run(core, f"{tag}-again", session))
    return out


@pytest.fixture(scope="module")
def without_tiers(model: Path) -> list[tuple[list[int], int]]:
    core = _engine(model)
    try:
        out = _session(core, "plain")
    finally:
        core.close()
    assert out[-1][1] == 0  # the pool evicted the session's prefix: all computed again
    return out


def test_a_host_tier_hit_restores_the_evicted_prefix(
    model: Path, without_tiers: list[tuple[list[int], int]]
) -> None:
    core = _engine(model, kv_host_memory_bytes=64 * MiB)
    try:
        out = _session(core, "host")
        stats = core.snapshot().kv_tiers  # what the worker's metrics read
    finally:
        core.close()
    assert [t for t, _ in out] == [t for t, _ in without_tiers]
    assert out[-1][1] == 64  # the session's four whole blocks, restored
    assert stats is not None and stats.offloaded > 0 and stats.restored >= 4
    assert stats.host_blocks > 0 and stats.dropped == 0
    REPORT["KV tiers: blocks restored from the host tier, tiny Llama session"] = (
        f"{stats.restored} ({stats.restore_s * 1e3:.2f} ms in all)"
    )


def test_the_disk_tier_survives_a_restart_and_refuses_what_it_cannot_check(
    model: Path, without_tiers: list[tuple[list[int], int]], tmp_path: Path
) -> None:
    """No host tier: evicted blocks go straight to disk. A new engine on the same
    directory restores the session from it; a corrupted file stops the prefix there;
    an int8 KV cache (another layout) finds nothing."""
    disk = {"kv_disk_dir": str(tmp_path), "kv_disk_bytes": 64 * MiB}
    core = _engine(model, **disk)
    try:
        out = _session(core, "disk")
    finally:
        core.close()
    want = without_tiers[0][0]
    assert [t for t, _ in out] == [t for t, _ in without_tiers]
    assert out[-1][1] == 64
    session = _prompts()[0]

    restarted = _engine(model, **disk)  # the files of the first engine
    try:
        assert _run(restarted, "after-restart", session) == (want, 64)
        assert restarted.kv.tiers is not None and restarted.kv.tiers.stats.disk_hits >= 4
    finally:
        restarted.close()

    files = sorted(tmp_path.rglob("*.kv"))
    assert files
    from protocol.kv_layout import hash_blocks

    third = hash_blocks(session, 16)[2]  # the session's third block, corrupted
    bad = next(f for f in files if f.stem == f"{third:016x}")
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(data)
    restarted = _engine(model, **disk)
    try:
        # the session's blocks were promoted to the host tier... of the engine that
        # closed: this one reads them from disk again, two good blocks, then the bad one
        assert _run(restarted, "corrupt", session) == (want, 32)
        assert restarted.kv.tiers is not None and restarted.kv.tiers.stats.disk_rejected == 1
        assert not bad.exists()
    finally:
        restarted.close()

    other_layout = _engine(model, kv_cache_dtype="int8", **disk)
    try:
        _, cached = _run(other_layout, "int8", session)
        assert cached == 0
    finally:
        other_layout.close()


def test_quantized_kv_blocks_move_as_they_are(model: Path) -> None:
    """An int8 KV cache: the host tier keeps each block's codes and scales, so the
    session restored gives the tokens the int8 engine gives without tiers."""
    plain = _engine(model, kv_cache_dtype="int8")
    try:
        want = _session(plain, "int8-plain")
    finally:
        plain.close()
    core = _engine(model, kv_cache_dtype="int8", kv_host_memory_bytes=64 * MiB)
    try:
        got = _session(core, "int8-host")
    finally:
        core.close()
    assert [t for t, _ in got] == [t for t, _ in want] and got[-1][1] == 64


def test_tiers_are_refused_where_they_cannot_run() -> None:
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(kv_disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="tensor parallel size 1"):
        EngineConfig(kv_host_memory_bytes=MiB, tensor_parallel_size=2)


def test_the_worker_exports_the_tiers() -> None:
    from engine.kv_cache.tiers import TierStats
    from worker.metrics import KvTierCounts

    stats = TierStats(offloaded=7, restored=4, host_blocks=3, disk_blocks=2, block_bytes=100)
    families = {f.name: f for f in KvTierCounts(lambda: stats).collect()}
    held = {s.labels["tier"]: s.value for s in families["diptych_worker_kv_tier_bytes"].samples}
    assert held == {"host": 300, "disk": 200}
    assert families["diptych_worker_kv_tier_offloaded_blocks"].samples[0].value == 7
    assert families["diptych_worker_kv_tier_restored_blocks"].samples[0].value == 4


def _byte_pool() -> tuple[torch.Tensor, Any, Any]:
    """Four 256-byte blocks of distinct bytes, and the read / write a `KvTiers` takes."""
    pool = torch.arange(4 * 64, dtype=torch.int32).view(4, 64).view(torch.uint8).view(4, -1)

    def read(ids: list[int]) -> list[torch.Tensor]:
        return [pool[b].clone() for b in ids]

    def write(ids: list[int], rows: list[torch.Tensor]) -> None:
        for b, r in zip(ids, rows, strict=True):
            pool[b].copy_(r)

    return pool, read, write


def test_a_prefetch_reads_disk_blocks_off_the_engine_thread(tmp_path: Path) -> None:
    """Blocks only the disk holds are read on the reader thread when a request arrives
    (`prefetch`); the lookup then takes the bytes read, and a block no tier holds is
    not fetched."""
    from engine.kv_cache.tiers import KvTiers

    pool, read, write = _byte_pool()
    tiers = KvTiers(256, 0, read, write, (tmp_path, 1 << 20))  # no host tier
    tiers.offload([(1, 11), (2, 12)])
    tiers.flush()
    want = [pool[1].clone(), pool[2].clone()]
    tiers.prefetch([10, 11, 12, 13])  # 10 and 13: no tier holds them
    assert sorted(tiers._fetching) == [11, 12]
    rows = [tiers.lookup(h) for h in (11, 12)]
    assert all(torch.equal(r, w) for r, w in zip(rows, want, strict=True))  # type: ignore[arg-type]
    assert tiers.lookup(13) is None and tiers.stats.disk_hits == 2
    tiers.close()


@pytest.mark.parametrize("host_bytes", [64 * MiB, 16 * 1024])
def test_kv_events_remove_a_block_only_when_no_tier_keeps_it(model: Path, host_bytes: int) -> None:
    """A router counts a block a tier keeps as held (a copy, not a prefill, brings it
    back): the pool's evictions into the host tier are not reported as removed but as
    moved there ("host"), the blocks the tier lets go of are removed (16 KiB: two of the
    tiny model's blocks). Applied in order, the events say where each block is now."""
    core = _engine(model, kv_host_memory_bytes=host_bytes)
    core.record_kv_events()
    try:
        _session(core, f"events{host_bytes}")
        events = core.drain_kv_events()
        assert core.kv.tiers is not None
        kept = set(core.kv.tiers._host)
        device = set(core.kv.pool.cached)
        stats = core.kv.tiers.stats
    finally:
        core.close()
    removed = [h for kind, hs in events if kind == "removed" for h in hs]
    assert any(kind == "stored" for kind, _ in events) and stats.offloaded > 0
    if host_bytes == 64 * MiB:
        assert removed == [] and stats.dropped == 0
    else:
        assert len(kept) == 2 and removed and not kept & set(removed)
        assert len(removed) <= stats.dropped
    where: dict[int, str] = {}
    for kind, hs in events:
        for h in hs:
            if kind == "removed":
                where.pop(h, None)
            else:
                where[h] = kind
    assert {h: k for h, k in where.items() if k == "stored"}.keys() == device
    assert {h for h, k in where.items() if k == "host"} == kept - device
    assert set(where) == device | kept


def test_a_crash_mid_write_leaves_nothing_that_is_served(tmp_path: Path) -> None:
    """What a worker killed while its disk tier writes can leave: a temporary file (the
    rename never happened) and, on a file system that reorders, a block file cut short.
    A new tier removes the first at start and refuses the second at its first read."""
    from engine.kv_cache.tiers import SUFFIX, KvTiers

    _, read, write = _byte_pool()
    disk = (tmp_path, 1 << 20)
    tiers = KvTiers(256, 0, read, write, disk)
    tiers.offload([(1, 21), (2, 22)])
    tiers.close()
    (good, cut) = sorted(tmp_path.rglob("*" + SUFFIX))
    cut.write_bytes(cut.read_bytes()[:100])  # the write cut short
    partial = cut.with_suffix(".tmp")
    partial.write_bytes(b"DKV1")  # a write the crash stopped before its rename
    dead = cut.with_suffix(f".{_dead_pid()}.tmp")  # a killed writer's, named by its pid
    dead.write_bytes(b"DKV1")
    live = cut.with_suffix(f".{os.getpid()}.tmp")  # a live writer's (sharing the directory)
    live.write_bytes(b"DKV1")
    again = KvTiers(256, 0, read, write, disk)
    try:
        assert not partial.exists() and not dead.exists() and live.exists()
        hashes = {int(good.stem, 16), int(cut.stem, 16)}
        assert hashes == {21, 22}
        ok, bad = int(good.stem, 16), int(cut.stem, 16)
        assert again.lookup(ok) is not None
        assert again.lookup(bad) is None and not cut.exists()
        assert again.stats.disk_rejected == 1 and again.drain_gone() == [bad]
    finally:
        again.close()


@pytest.mark.parametrize("virtual", [False, True])
def test_the_simulated_engine_keeps_a_host_tier(virtual: bool) -> None:
    """A simulated engine (a fleet simulation's worker) with a host tier: the session's
    evicted prefix comes back as cached, its deterministic tokens unchanged, and the
    copy's time (the device's block bytes over the host link) lands on the next step."""
    from engine.sim.config import SimConfig
    from engine.sim.runner import HOST_LINK_BYTES_PER_S, SimModelRunner

    def core(**kw: Any) -> EngineCore:
        sim = SimConfig(profile="H200:Llama-3.1-70B:tp8", speedup=1e9, virtual=virtual)
        return EngineCore(EngineConfig(sim=sim, num_blocks=12, max_num_seqs=1, **kw))

    plain, tiered = core(), core(kv_host_memory_bytes=64 << 30)
    try:
        want, got = _session(plain, "sim-plain"), _session(tiered, "sim-tiers")
        runner = tiered.runner
        assert isinstance(runner, SimModelRunner)
        assert tiered.kv.tiers is not None and tiered.kv.tiers.stats.restored == 4
        per_block = runner.tier_block_bytes / HOST_LINK_BYTES_PER_S
    finally:
        plain.close()
        tiered.close()
    assert [t for t, _ in got] == [t for t, _ in want]
    assert want[-1][1] == 0 and got[-1][1] == 64
    assert per_block > 0
    with pytest.raises(ValueError, match="host tier only"):
        EngineConfig(sim=SimConfig(), kv_disk_dir="/tmp/x", kv_disk_bytes=1 << 30)


def test_a_session_hold_keeps_the_history_on_the_device(
    model: Path, without_tiers: list[tuple[list[int], int]]
) -> None:
    """The real engine with --kv-session-ttl: the session's turn holds its 5 blocks while
    three other requests pass through the 6 left, so the next turn finds its whole
    prefix on the device, with the same greedy tokens as recomputing it; the hold shows
    in the snapshot and lets go when the engine needs room."""
    session, *others = _prompts()
    core = _engine(model, kv_session_ttl_s=600.0)
    try:
        out = [_run(core, "turn1", session, "s")]
        snap = core.snapshot()
        assert (snap.sessions_held, snap.session_blocks) == (1, 5)
        out += [_run(core, f"other{i}", p) for i, p in enumerate(others)]
        out.append(_run(core, "turn2", session, "s"))
        assert core.snapshot().sessions_released_for_room == 0
        big = _prompts()[1] * 2  # 140 tokens + 8: 10 of the 11 blocks, so the hold yields
        _run(core, "big", big[:150])
        snap = core.snapshot()
        assert snap.sessions_released_for_room == 1 and snap.sessions_held == 0
        assert core.is_idle()
    finally:
        core.close()
    assert [t for t, _ in out] == [t for t, _ in without_tiers]
    assert out[-1][1] == 64 and without_tiers[-1][1] == 0


def test_an_idle_session_moves_to_the_host_tier_while_the_engine_waits(
    model: Path, without_tiers: list[tuple[list[int], int]]
) -> None:
    """Past --kv-session-ttl the held turn's 4 full blocks are copied to the host tier at
    once (the engine's next schedule), not when other requests' allocations evict them:
    those evictions copy nothing of it again, and the next turn is restored whole."""
    session, *others = _prompts()
    core = _engine(model, kv_session_ttl_s=5.0, kv_host_memory_bytes=64 * MiB)
    now = [0.0]
    core.scheduler.clock = lambda: now[0]
    tiers = core.kv.tiers
    assert tiers is not None
    try:
        out = [_run(core, "turn1", session, "s")]
        assert tiers.stats.offloaded == 0
        now[0] = 5.0
        core.step()  # idle: expires the hold, copies its blocks
        assert tiers.stats.offloaded == 4 and core.snapshot().sessions_expired == 1
        held = set(tiers._host)  # the session's 4 blocks
        copied: list[int] = []
        put = tiers._host_put
        tiers._host_put = lambda h, row: (copied.append(h), put(h, row))[1]  # type: ignore[method-assign]
        out += [_run(core, f"other{i}", p) for i, p in enumerate(others)]
        out.append(_run(core, "turn2", session, "s"))
        assert core.is_idle() or core.snapshot().sessions_held == 1
    finally:
        core.close()
    assert copied and not held & set(copied)  # others' blocks evicted; the session's not again
    assert [t for t, _ in out] == [t for t, _ in without_tiers]
    assert out[-1][1] == 64 and tiers.stats.restored == 4


def _dead_pid() -> int:
    """A pid no process has here (a child that ran and was reaped)."""
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_workers_sharing_a_disk_directory_find_each_others_blocks(tmp_path: Path) -> None:
    """Two decode workers of one model on one host share --kv-disk-dir: a block one
    wrote after the other started is found by the other, read back intact, and one the
    writer then evicted is a plain miss for the other (not a refused file)."""
    from engine.kv_cache.tiers import KvTiers

    pool, read, write = _byte_pool()
    disk = (tmp_path, 1 << 20)
    a, b = KvTiers(256, 0, read, write, disk), KvTiers(256, 0, read, write, disk)
    try:
        a.offload([(1, 31)])
        a.flush()
        row = b.lookup(31)
        assert row is not None and torch.equal(row, pool[1])
        b.offload([(1, 31)])  # b's own eviction of that block: already on disk, kept
        b.flush()
        assert b.stats.disk_writes == 0
        a.offload([(2, 32)])
        a.flush()
        assert 32 in b.disk  # type: ignore[operator]
        a.disk._forget(32)  # type: ignore[union-attr]  # a evicts it
        assert b.lookup(32) is None and b.stats.disk_rejected == 0
    finally:
        a.close()
        b.close()
