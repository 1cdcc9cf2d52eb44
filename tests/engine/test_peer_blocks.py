"""A prefix moved between two engines' pools (a decode worker's pull from a peer,
decode_worker/peer_kv.py), on a tiny Llama in fp32: the puller reserves blocks, the
holder pins what it holds (restoring a host tier's blocks into its pool first), the
bytes are copied, the puller caches them. The puller's greedy tokens are those it
computes without the pull, its prefix-cache hit covers the pulled blocks, and both pools
return to idle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from protocol.kv_layout import hash_blocks
from tests.engine.test_kv_tiers import _run
from tests.engine.test_models_safetensors import _write

BS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, path = _write(tmp_path_factory.mktemp("peer"), "llama", sharded=False)
    return Path(path)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 250, (70,), generator=g).tolist() for _ in range(n)]


def _engine(model: Path, **kw: object) -> EngineCore:
    # 11 usable blocks: a 70-token prompt takes 5
    return EngineCore(EngineConfig(model=str(model), dtype="float32", num_blocks=12,
                                   max_num_seqs=1, **kw))  # type: ignore[arg-type]  # fmt: skip


def _pull(puller: EngineCore, holder: EngineCore, rid: str, prompt: list[int]) -> int:
    """The pull's engine calls, the transfer replaced by a copy of the blocks' bytes."""
    hashes = hash_blocks(prompt[: (len(prompt) - 1) // BS * BS], BS)
    have, dst = puller.reserve_peer_blocks(f"pull {rid}", hashes)
    want = hashes[have : have + len(dst)]
    src = holder.pin_peer_blocks(f"push {rid}", want)
    puller.runner.write_blocks(dst[: len(src)], holder.runner.read_blocks(src))
    holder.release_peer_blocks(f"push {rid}")
    return puller.commit_peer_blocks(f"pull {rid}", want[: len(src)])


def _idle(*cores: EngineCore) -> None:
    for core in cores:
        assert not core.check_invariants()
        assert core.is_idle()


def test_a_pulled_prefix_gives_the_tokens_computing_it_does(model: Path) -> None:
    holder, puller, alone = _engine(model), _engine(model), _engine(model)
    (prompt,) = _prompts(1)
    expected, _ = _run(alone, "r", prompt)
    assert _run(holder, "r", prompt) == (expected, 0)
    assert _pull(puller, holder, "r", prompt) == 4  # (70 - 1) // 16 whole blocks
    assert _run(puller, "r", prompt) == (expected, 4 * BS)
    _idle(holder, puller)
    # a second pull finds the blocks held already and reserves nothing
    assert puller.reserve_peer_blocks("pull again", hash_blocks(prompt[:64], BS)) == (4, [])
    puller.release_peer_blocks("pull again")
    _idle(puller)


def test_the_holder_restores_its_host_tier_blocks_for_the_pull(model: Path) -> None:
    holder = _engine(model, kv_host_memory_bytes=1 << 20)
    puller, alone = _engine(model), _engine(model)
    prompt, *others = _prompts(3)
    expected, _ = _run(alone, "r", prompt)
    _run(holder, "r", prompt)
    for i, other in enumerate(others):  # take the holder's pool over: the prefix leaves it
        _run(holder, f"o{i}", other)
    tiers = holder.kv.tiers
    assert tiers is not None
    restored = tiers.stats.restored
    assert holder.snapshot().prefix_hit(prompt) < 4 * BS  # not all of it on the device any more
    assert _pull(puller, holder, "r", prompt) == 4
    assert tiers.stats.restored > restored  # copied back into the holder's pool first
    assert _run(puller, "r", prompt) == (expected, 4 * BS)
    _idle(holder, puller)


def test_a_pull_of_what_the_holder_lacks_moves_nothing(model: Path) -> None:
    holder, puller = _engine(model), _engine(model)
    prompt, unseen = _prompts(2)
    _run(holder, "r", prompt)
    assert _pull(puller, holder, "x", unseen) == 0
    _idle(holder, puller)
    # a reservation bigger than the free pool takes what is free; one owner holds once
    hashes = hash_blocks(unseen[:64], BS)
    have, dst = puller.reserve_peer_blocks("pull big", hashes * 3)
    assert have == 0 and len(dst) == 11
    with pytest.raises(ValueError, match="holds blocks already"):
        puller.reserve_peer_blocks("pull big", hashes)
    puller.release_peer_blocks("pull big")
    _idle(puller)


def test_a_reservation_keeps_the_head_of_the_chain_it_continues(model: Path) -> None:
    """The blocks a peer writes continue the prefix this pool holds: reserving room for
    them must not evict that prefix (a full pool takes the room from elsewhere)."""
    core = _engine(model)
    prompt, other = _prompts(2)
    _run(core, "r", prompt)  # 4 whole blocks cached, all 11 blocks free
    head = hash_blocks(prompt[:64], BS)
    tail = hash_blocks(other[:64], BS) * 2  # 8 blocks this pool lacks
    have, dst = core.reserve_peer_blocks("pull r", head + tail)
    assert have == 4 and len(dst) == 7  # the 11 free less the 4 pinned head blocks
    assert all(core.kv.pool.lookup(h) is not None for h in head)
    core.release_peer_blocks("pull r")
    _idle(core)


@pytest.mark.parametrize("let_go", ["release", "commit"])
def test_a_queue_stalled_behind_a_peers_blocks_moves_when_they_are_let_go(
    model: Path, let_go: str
) -> None:
    """A request that cannot start while a pull's reservation holds the pool stalls the
    queue (no step can run). The reservation's end, released (the peer gone: after its
    timeout) or committed, must wake the queue: no other event may ever come."""
    core, alone = _engine(model), _engine(model)
    prompt, unseen = _prompts(2)
    expected, _ = _run(alone, "r", prompt)
    hashes = hash_blocks(unseen[:64], BS) * 3
    have, dst = core.reserve_peer_blocks("pull big", hashes)  # the whole free pool
    assert (have, len(dst)) == (0, 11)
    core.submit(NewRequest("r", prompt, SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True)))  # fmt: skip
    assert core.step() == [] and not core.has_work()  # stalled: nothing can start
    if let_go == "release":
        core.release_peer_blocks("pull big")
    else:  # (the peer wrote none of them: nothing is cached, every block goes back)
        assert core.commit_peer_blocks("pull big", []) == 0
    assert core.has_work()
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for o in core.step():
            tokens += o.new_token_ids
    assert tokens == expected
    _idle(core)
