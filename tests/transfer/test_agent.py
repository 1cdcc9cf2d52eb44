"""The agent API in one process (shm and tcp only: they listen on loopback alone)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from transfer import (
    Agent,
    AgentClosedError,
    AuthenticationError,
    BackendUnavailableError,
    DescList,
    DescriptorError,
    LayoutMismatchError,
    OutOfBoundsError,
    PeerRejectedError,
    PeerRestartedError,
    TransferError,
    UnknownPeerError,
    make_plan,
)

BLOCK = 4096


@pytest.fixture
def agents(request: pytest.FixtureRequest) -> Iterator[tuple[Agent, Agent]]:
    kind = getattr(request, "param", "tcp")
    a, b = Agent("prefill", backend=kind), Agent("decode", backend=kind)
    a.allocate(64 * BLOCK)
    b.allocate(64 * BLOCK)
    a.add_remote(b.metadata())
    b.add_remote(a.metadata())
    yield a, b
    a.close()
    b.close()


def _fill(a: Agent, seed: int = 0) -> np.ndarray:
    pool = a.regions[0].numpy()
    pool[:] = np.random.default_rng(seed).integers(0, 256, pool.size, dtype=np.uint8)
    return pool


def blocks(a: Agent, ids: list[int]) -> np.ndarray:
    pool = a.regions[0].numpy().reshape(-1, BLOCK)
    return pool[ids]


@pytest.mark.parametrize("agents", ["shm", "tcp"], indirect=True)
async def test_write_read_notify_from_an_event_loop(agents: tuple[Agent, Agent]) -> None:
    a, b = agents
    _fill(a)
    w = a.write(
        DescList.blocks(0, [3, 4, 5, 60], BLOCK),
        "decode",
        DescList.blocks(0, [10, 11, 2, 40], BLOCK),
        notification=b"w",
    )
    await w.wait(10)
    r = a.read(
        DescList.blocks(0, [20, 21], BLOCK),
        "decode",
        DescList.blocks(0, [11, 10], BLOCK),
        notification=b"r",
    )
    n = a.notify("decode", b"n")
    await asyncio.gather(r.wait(10), n.wait(10))
    got: list[tuple[str, bytes]] = []
    async for note in b.notifications():
        got.append((note.kind, note.payload))
        if len(got) == 3:
            break
    assert got[0] == ("write", b"w")  # awaited before the others were posted
    assert sorted(got[1:]) == [("notify", b"n"), ("read", b"r")]
    assert np.array_equal(blocks(b, [10, 11, 2, 40]), blocks(a, [3, 4, 5, 60]))
    assert np.array_equal(blocks(a, [20, 21]), blocks(a, [4, 3]))
    sa, sb = a.stats(), b.stats()
    assert (sa["bytes_written"], sa["bytes_read"], sa["transfers_done"]) == (
        4 * BLOCK,
        2 * BLOCK,
        3,
    )
    assert (sb["bytes_received"], sb["bytes_served"], sb["notifications_delivered"]) == (
        4 * BLOCK,
        2 * BLOCK,
        3,
    )


def test_backend_preference_picks_shm_on_the_same_host_and_tcp_otherwise() -> None:
    with (
        Agent("a", backend=("shm", "tcp")) as a,
        Agent("b", backend=("shm", "tcp")) as b,
        Agent("c", backend="tcp") as c,
    ):
        assert a.add_remote(b.metadata()) == "b" and a.backend_for("b") == "shm"
        a.add_remote(c.metadata())
        assert a.backend_for("c") == "tcp"
        elsewhere = json.loads(b.metadata())
        elsewhere["shm_domain"] = "another-host"
        with Agent("d", backend=("shm", "tcp")) as d:
            d.add_remote(json.dumps(elsewhere))
            assert d.backend_for("b") == "tcp"
        with (
            Agent("e", backend="shm") as e,
            pytest.raises(TransferError, match="no common backend"),
        ):
            e.add_remote(c.metadata())


def test_layout_hash_is_carried_and_checked() -> None:
    layout = "20686f7deb49681f"  # opaque to the transfer layer
    with Agent("a", backend="tcp") as a, Agent("b", backend="tcp", layout=layout) as b:
        a.add_remote(b.metadata(), expect_layout=layout)
        assert a.remote("b").layout == layout
        with pytest.raises(LayoutMismatchError):
            a.add_remote(b.metadata(), expect_layout="0123456789abcdef")


def test_bad_requests_raise_before_anything_moves(agents: tuple[Agent, Agent]) -> None:
    a, _ = agents
    with pytest.raises(UnknownPeerError, match="add its metadata"):
        a.write(DescList.blocks(0, [0], BLOCK), "nobody", DescList.blocks(0, [0], BLOCK))
    with pytest.raises(ValueError):
        a.add_remote(a.metadata())
    with pytest.raises(DescriptorError, match="local side has"):
        a.write(DescList.blocks(0, [0], BLOCK), "decode", DescList.blocks(0, [0, 1], BLOCK))
    with pytest.raises(OutOfBoundsError, match="local"):
        a.write(DescList.blocks(0, [64], BLOCK), "decode", DescList.blocks(0, [0], BLOCK))
    with pytest.raises(OutOfBoundsError, match="'decode'"):
        a.write(DescList.blocks(0, [0], BLOCK), "decode", DescList.blocks(0, [64], BLOCK))
    with pytest.raises(OutOfBoundsError, match="unknown region 3"):
        a.write(DescList.blocks(0, [0], BLOCK), "decode", DescList.blocks(3, [0], BLOCK))
    assert a.stats()["rejected_out_of_bounds"] == 3
    assert a.stats()["writes_posted"] == 0


def test_prepared_lists_are_reused_and_invalidated_by_a_restart(
    agents: tuple[Agent, Agent],
) -> None:
    a, b = agents
    _fill(a, 1)
    local = a.prepare(DescList.blocks(0, range(8, 16), BLOCK))
    # eight adjacent blocks onto eight adjacent blocks move as one range
    assert len(make_plan(local.descs, DescList.blocks(0, range(8), BLOCK))) == 1
    remote = a.prepare_remote("decode", DescList.blocks(0, [1, 3, 5, 7, 9, 11, 13, 15], BLOCK))
    for _ in range(3):
        a.write(local, "decode", remote).result(10)
    assert np.array_equal(blocks(b, [1, 3, 5, 7, 9, 11, 13, 15]), blocks(a, list(range(8, 16))))
    with pytest.raises(DescriptorError):
        a.write(remote, "decode", local)
    with Agent("decode", backend="tcp") as b2:  # decode restarted
        b2.allocate(64 * BLOCK)
        a.add_remote(b2.metadata())
        with pytest.raises(PeerRestartedError):
            a.write(local, "decode", remote)
        remote2 = a.prepare_remote("decode", remote.descs)
        b2.add_remote(a.metadata())
        a.write(local, "decode", remote2).result(10)


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_old_and_removed_incarnations_are_refused(kind: str) -> None:
    with Agent("decode", backend=kind) as b, Agent("prefill", backend=kind) as a1:
        b.allocate(BLOCK)
        a1.allocate(BLOCK)
        b.add_remote(a1.metadata())
        one = (DescList.blocks(0, [0], BLOCK), "decode", DescList.blocks(0, [0], BLOCK))
        with Agent("prefill", backend=kind) as a2:  # prefill restarted; b not told yet
            a2.allocate(BLOCK)
            a2.add_remote(b.metadata())
            with pytest.raises(PeerRejectedError, match="stale-peer"):
                a2.write(*one).result(10)
            assert b.stats()["rejected_stale_peer"] == 1
            b.add_remote(a2.metadata())
            a2.write(*one).result(10)
        assert b.remove_remote("prefill") and not b.remove_remote("prefill")
        a1.add_remote(b.metadata())
        with pytest.raises(PeerRejectedError, match="unknown-peer"):
            a1.write(*one).result(10)
        assert b.stats()["rejected_unknown_peer"] == 1
        assert b.get_notifications() == []


def test_a_peer_that_cannot_prove_its_secret_is_refused(agents: tuple[Agent, Agent]) -> None:
    _a, b = agents
    forged = json.loads(b.metadata())
    forged["secret"] = "00" * 32  # whoever answers does not hold this secret
    with Agent("prefill2", backend="tcp") as c:
        c.allocate(BLOCK)
        c.add_remote(json.dumps(forged))
        b.add_remote(c.metadata())
        with pytest.raises(AuthenticationError):
            c.write(
                DescList.blocks(0, [0], BLOCK), "decode", DescList.blocks(0, [0], BLOCK)
            ).result(10)


def test_registered_tensors_are_tcp_targets_but_not_shm_targets() -> None:
    with Agent("a", backend=("shm", "tcp")) as a, Agent("b", backend="tcp") as b:
        kv = torch.zeros(4, 256, dtype=torch.float32)
        b.register(kv)
        src = a.register(torch.arange(1024, dtype=torch.float32))
        a.add_remote(b.metadata())
        b.add_remote(a.metadata())
        a.write(DescList([(src, 0, 4096)]), "b", DescList([(0, 0, 4096)])).result(10)
        assert torch.equal(kv.reshape(-1), torch.arange(1024, dtype=torch.float32))
    with Agent("a", backend="shm") as a, Agent("b", backend="shm") as b:
        b.register(torch.zeros(1024))
        a.allocate(4096)
        a.add_remote(b.metadata())
        with pytest.raises(OutOfBoundsError, match="not in shared memory"):
            a.write(DescList([(0, 0, 4096)]), "b", DescList([(0, 0, 4096)]))


async def test_closing_fails_pending_work_ends_iteration_and_refuses_new_work(
    agents: tuple[Agent, Agent],
) -> None:
    a, b = agents
    it = b.notifications()
    waiter = asyncio.create_task(it.next())
    await asyncio.sleep(0.01)
    await b.aclose()
    with pytest.raises(StopAsyncIteration):
        await waiter
    with pytest.raises(AgentClosedError):
        b.allocate(10)
    h = a.write(DescList.blocks(0, [0], BLOCK), "decode", DescList.blocks(0, [0], BLOCK))
    with pytest.raises(TransferError):  # the receiver is gone
        h.result(10)
    a.close()
    a.close()  # idempotent


def test_backend_choice_is_validated_and_auto_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer.backends as backends

    with pytest.raises(ValueError, match="backend must be"):
        Agent("a", backend="carrier-pigeon")
    with pytest.raises(ValueError, match="advertise_host"):
        Agent("a", backend="tcp", host="0.0.0.0")  # refused before anything binds
    monkeypatch.setattr(backends, "available", lambda kind: kind not in ("nixl", "ucx"))
    with pytest.raises(BackendUnavailableError, match="pip install"):
        Agent("a", backend="nixl")
    with Agent("a") as a:  # auto without nixl: shared memory first, then tcp
        assert a.backends == ["shm", "tcp"]
        assert set(a.describe().transports) == {"shm", "tcp"}
