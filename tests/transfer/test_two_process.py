"""Every backend, two (or three) real processes: the must-show behaviours.

* scattered random blocks arrive bit-exact; each notification arrives once and
  only after its data (the receiver hashes the blocks the moment it arrives);
* out-of-bounds and unknown-peer writes are refused and counted;
* a peer killed mid-transfer fails the handles without a hang, and a restarted
  peer (new incarnation) works again once its new metadata is added.

nixl is one-sided: the receiver cannot refuse bytes, so for it the refusals
are the initiator's (and NIXL's) checks plus a notification that is never
delivered, and in-flight writes may legitimately complete before the kill.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from typing import Any

import numpy as np
import pytest

from tests.transfer.harness import PeerError, PeerProcess

pytestmark = pytest.mark.slow

BACKENDS = ["shm", "tcp", "nixl", "ucx"]
# Writes complete when the receiver acknowledges them. shm writes complete on placement
# (as NIXL's do): the bytes are in the peer's memory once copied, whatever it says.
TWO_SIDED = {"tcp", "ucx"}
BLOCK = 8 << 10
BLOCKS = 512
POOL = BLOCK * BLOCKS


def start(
    spawn: Any,
    kind: str,
    name: str,
    pool: int = POOL,
    block: int = BLOCK,
    isolated: bool | None = None,
    **kw: Any,
) -> tuple[PeerProcess, str]:
    p = spawn(kind, isolated)
    md = p.call("init", name=name, backend=kind, pool_bytes=pool, block_bytes=block, **kw)["md"]
    return p, md


def pair(spawn: Any, kind: str, **kw: Any) -> tuple[PeerProcess, PeerProcess, str, str]:
    a, md_a = start(spawn, kind, "prefill", **kw)
    b, md_b = start(spawn, kind, "decode", **kw)
    a.call("add_remote", md=md_b)
    b.call("add_remote", md=md_a)
    return a, b, md_a, md_b


def wait_notes(p: PeerProcess, n: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        notes = p.call("notes")
        if len(notes) >= n:
            return notes
        time.sleep(0.02)
    raise AssertionError(f"got {len(p.call('notes'))} of {n} notifications")


def scattered(rng: np.random.Generator, free: list[int], n: int, runs: bool) -> list[int]:
    """Pop `n` blocks from `free`: random ones, or a few adjacent runs (coalescing)."""
    if not runs:
        return [free.pop(int(rng.integers(len(free)))) for _ in range(n)]
    free.sort()
    start_i = int(rng.integers(0, len(free) - n))
    out = free[start_i : start_i + n]
    del free[start_i : start_i + n]
    return out


@pytest.mark.parametrize("kind", BACKENDS)
def test_scattered_blocks_bit_exact_notified_once_after_data(spawn: Any, kind: str) -> None:
    a, b, _, _ = pair(spawn, kind)
    a.call("fill", seed=1)
    rng = np.random.default_rng(7)
    src_free, dst_free = list(range(BLOCKS)), list(range(BLOCKS))
    moves = []
    for k in range(12):  # posted back to back: pipelined
        n = int(rng.integers(1, 40))
        src = scattered(rng, src_free, n, runs=k % 3 == 0)
        dst = scattered(rng, dst_free, n, runs=k % 2 == 0)
        note = json.dumps({"id": k, "blocks": dst, "digest": a.call("digest", blocks=src)})
        a.call("write", peer="decode", src=src, dst=dst, note=note)
        moves.append((src, dst))
    assert [r["state"] for r in a.call("wait")] == ["done"] * 12

    notes = wait_notes(b, 12)
    assert sorted(json.loads(_payload(n))["id"] for n in notes) == list(range(12))
    assert all(n["verified"] and n["kind"] == "write" and n["peer"] == "prefill" for n in notes)
    for src, dst in moves:
        assert b.call("digest", blocks=dst) == a.call("digest", blocks=src)
    nbytes = sum(len(s) for s, _ in moves) * BLOCK
    assert b.call("stats")["bytes_received"] == nbytes

    # READ scattered blocks back from the receiver, with a notification for it.
    src, dst = moves[0][1][:5], list(range(BLOCKS - 5, BLOCKS))
    rid = a.call("read", peer="decode", src=src, dst=dst, note="read-done")
    assert a.call("wait", ids=[rid])[0]["state"] == "done"
    assert a.call("digest", blocks=dst) == b.call("digest", blocks=src)
    nid = a.call("notify", peer="decode", payload="bare")
    assert a.call("wait", ids=[nid])[0]["state"] == "done"

    notes = wait_notes(b, 14)
    time.sleep(0.3)  # nothing is delivered twice
    notes = b.call("notes")
    assert len(notes) == 14
    assert [(n["kind"], _payload(n)) for n in notes[12:]] == [
        ("read", "read-done"),
        ("notify", "bare"),
    ]
    assert b.call("stats")["notifications_delivered"] == 14


def _payload(note: dict[str, Any]) -> str:
    import base64

    return base64.b64decode(note["payload"]).decode()


def _tampered(md: str, **region_changes: Any) -> str:
    """`md` with region 0 changed, or a phantom region appended (`phantom=True`)."""
    d = json.loads(md)
    if region_changes.pop("phantom", False):
        d["regions"].append({**d["regions"][0], "id": 1})
    d["regions"][0].update(region_changes)
    return json.dumps(d)


@pytest.mark.parametrize("kind", BACKENDS)
def test_out_of_bounds_and_unknown_peer_writes_are_refused_and_counted(
    spawn: Any, kind: str
) -> None:
    a, b, _, md_b = pair(spawn, kind)
    a.call("fill", seed=2)
    before = b.call("digest", blocks=list(range(BLOCKS)))

    # 1. The writer refuses a range past the advertised region before posting.
    with pytest.raises(PeerError) as e:
        a.call("write", peer="decode", src=[0], dst=[BLOCKS])
    assert e.value.type == "OutOfBoundsError"
    assert a.call("stats")["rejected_out_of_bounds"] == 1

    # 2. A writer holding lying metadata (region 0 twice its size): the range
    #    passes the writer's check; the receiver (or, one-sided, the mapping /
    #    NIXL registration check) refuses it.
    a.call("add_remote", md=_tampered(md_b, nbytes=2 * POOL))
    h = a.call("write", peer="decode", src=[1], dst=[BLOCKS + 3], note="never")
    res = a.call("wait", ids=[h])[0]
    assert res["state"] == "failed", res
    h = a.call("read", peer="decode", src=[BLOCKS + 3], dst=[2])  # the same lie, read
    res_read = a.call("wait", ids=[h])[0]
    assert res_read["state"] == "failed", res_read
    if kind in ("tcp", "ucx"):
        for r in (res, res_read):
            assert r["type"] == "PeerRejectedError" and "out-of-bounds" in r["error"], r
        assert b.call("stats")["rejected_out_of_bounds"] == 2
    elif kind == "nixl":  # NIXL's own check: no registration of the peer covers it
        assert res["type"] == res_read["type"] == "OutOfBoundsError", (res, res_read)

    # 3. A phantom region 1 (aliasing region 0's memory): two-sided receivers
    #    refuse it; one-sided ones refuse the notification. Either way counted.
    a.call("add_remote", md=_tampered(md_b, phantom=True))
    h = a.call("write", peer="decode", src=[2], dst=[7], note="phantom", region=1)
    res = a.call("wait", ids=[h])[0]
    if kind in TWO_SIDED:
        assert res["state"] == "failed" and res["type"] == "PeerRejectedError", res
    _eventually(
        lambda: b.call("stats")["rejected_out_of_bounds"] >= (2 if kind in ("tcp", "ucx") else 1)
    )
    if kind == "shm":  # placed, then refused: the receiver's NACK is counted here too
        _eventually(lambda: a.call("stats")["rejected_after_placement"] == 1)

    # 4. A stranger the receiver never added.
    c, _ = start(spawn, kind, "stranger")
    c.call("add_remote", md=md_b)
    c.call("fill", seed=3)
    h = c.call("write", peer="decode", src=[0, 1], dst=[10, 11], note="stranger")
    res = c.call("wait", ids=[h])[0]
    if kind in TWO_SIDED or kind == "shm":  # shm: refused at the handshake, before a copy
        assert res["state"] == "failed" and res["type"] == "PeerRejectedError", res
        assert "unknown-peer" in res["error"]
    _eventually(lambda: b.call("stats")["rejected_unknown_peer"] >= 1)

    time.sleep(0.2)
    assert b.call("notes") == []  # nothing refused was ever announced
    if kind in ("tcp", "ucx"):  # two-sided: not one refused byte landed
        assert b.call("digest", blocks=list(range(BLOCKS))) == before


def _eventually(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


@pytest.mark.parametrize("kind", BACKENDS)
def test_peer_killed_mid_transfer_fails_handles_then_restart_works(spawn: Any, kind: str) -> None:
    big_block, big_blocks = 256 << 10, 128  # 32 MiB pools, 8 MiB writes
    pool = big_block * big_blocks
    a, b, md_a, _ = pair(spawn, kind, pool=pool, block=big_block)
    a.call("fill", seed=4)
    warm = a.call("write", peer="decode", src=[0], dst=[0])  # connected and authenticated
    assert a.call("wait", ids=[warm])[0]["state"] == "done"
    b.signal(signal.SIGSTOP)  # frozen receiver: writes stay in flight
    ids = [
        a.call(
            "write",
            peer="decode",
            src=list(range(i * 32, i * 32 + 32)),
            dst=list(range(32)),
            note=f"w{i}",
        )
        for i in range(4)
    ]
    time.sleep(0.5)
    if kind in TWO_SIDED:
        assert a.call("states")[1:] == ["pending"] * 4
    b.kill()
    t0 = time.monotonic()
    results = a.call("wait", ids=ids, timeout=20)
    assert all(r["state"] != "pending" for r in results), results  # nobody hangs
    assert time.monotonic() - t0 < 20
    if kind in TWO_SIDED:  # the first was in flight; later ones may find the peer gone
        assert results[0]["type"] == "PeerDisconnectedError", (results, a.tail())
        assert {r["type"] for r in results} <= {"PeerDisconnectedError", "PeerUnreachableError"}

    # The dead peer's address now refuses at once.
    h = a.call("write", peer="decode", src=[0], dst=[0])
    res = a.call("wait", ids=[h], timeout=20)[0]
    assert res["state"] == "failed", res

    # Restarted decode worker: new incarnation, new metadata, works again.
    b2, md_b2 = start(spawn, kind, "decode", pool=pool, block=big_block)
    b2.call("add_remote", md=md_a)
    a.call("add_remote", md=md_b2)
    assert json.loads(md_b2)["incarnation"] != json.loads(md_a)["incarnation"]
    src, dst = [5, 9, 77], [3, 4, 100]
    note = json.dumps({"blocks": dst, "digest": a.call("digest", blocks=src)})
    h = a.call("write", peer="decode", src=src, dst=dst, note=note)
    assert a.call("wait", ids=[h])[0]["state"] == "done"
    notes = wait_notes(b2, 1)
    assert notes[0]["verified"] and notes[0]["peer"] == "prefill"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_restarted_peer_on_same_address_is_detected(spawn: Any) -> None:
    port = _free_port()
    a, b, md_a, _ = pair(spawn, "tcp")
    b.kill()
    b, md_b = start(spawn, "tcp", "decode", port=port)
    a.call("add_remote", md=md_b)
    b.kill()
    b2, md_b2 = start(spawn, "tcp", "decode", port=port)  # same address, new incarnation
    b2.call("add_remote", md=md_a)
    h = a.call("write", peer="decode", src=[0], dst=[0])  # still holding the old metadata
    res = a.call("wait", ids=[h])[0]
    assert res["type"] == "PeerRestartedError", res
    a.call("add_remote", md=md_b2)
    h = a.call("write", peer="decode", src=[0], dst=[0])
    assert a.call("wait", ids=[h])[0]["state"] == "done"
    assert b2.call("stats")["rejected_stale_peer"] == 1


def test_auto_picks_nixl_between_auto_peers_and_tcp_with_a_tcp_peer(spawn: Any) -> None:
    a, md_a = start(spawn, "auto", "prefill")
    b, md_b = start(spawn, "auto", "decode")
    c, md_c = start(spawn, "tcp", "legacy", isolated=True)
    assert a.call("add_remote", md=md_b) == "decode"
    assert a.call("backend_for", name="decode") == "nixl"
    a.call("add_remote", md=md_c)
    assert a.call("backend_for", name="legacy") == "tcp"
    c.call("add_remote", md=md_a)
    b.call("add_remote", md=md_a)
    a.call("fill", seed=5)
    for peer, proc in (("decode", b), ("legacy", c)):
        note = json.dumps({"blocks": [3], "digest": a.call("digest", blocks=[9])})
        h = a.call("write", peer=peer, src=[9], dst=[3], note=note)
        res = a.call("wait", ids=[h])[0]
        assert res["state"] == "done", res
        assert wait_notes(proc, 1)[0]["verified"]


@pytest.mark.parametrize("kind", ["shm", "tcp"])
def test_only_peers_holding_the_deployment_secret_are_served(
    spawn: Any, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With DIPTYCH_CLUSTER_SECRET set, a peer needs it as well as the metadata: one
    started with another deployment secret fails the handshake, though each side was
    handed the other's metadata; peers sharing it transfer as before."""
    monkeypatch.setenv("DIPTYCH_CLUSTER_SECRET", "ours")
    a, b, _, md_b = pair(spawn, kind)
    a.call("fill", seed=4)
    h = a.call("write", peer="decode", src=[0], dst=[5], note="ours")
    assert a.call("wait", ids=[h])[0]["state"] == "done"
    monkeypatch.setenv("DIPTYCH_CLUSTER_SECRET", "theirs")
    c, md_c = start(spawn, kind, "outsider")
    c.call("add_remote", md=md_b)
    b.call("add_remote", md=md_c)  # even a known peer
    c.call("fill", seed=5)
    h = c.call("write", peer="decode", src=[0], dst=[6], note="theirs")
    res = c.call("wait", ids=[h])[0]
    assert res["state"] == "failed", res
    time.sleep(0.2)
    assert [n["peer"] for n in b.call("notes")] == ["prefill"]  # the outsider's never came


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_guarded_region_takes_writes_only_under_their_grant(spawn: Any, kind: str) -> None:
    """A decode worker's KV pool is guarded: a peer it trusts (it holds the metadata
    and the secret) writes there only the blocks a grant names, and once one peer
    used a grant no other may. Two-sided backends refuse before a byte lands; on
    one-sided ones the receiver refuses the notification. A refused use of a live
    grant is announced to the receiver as a "violation" under that grant."""
    a, b, _, md_b = pair(spawn, kind)
    c, md_c = start(spawn, kind, "rogue")
    c.call("add_remote", md=md_b)
    b.call("add_remote", md=md_c)
    a.call("fill", seed=7)
    c.call("fill", seed=8)
    b.call("guard")
    before = b.call("digest", blocks=[20, 40])

    def outcome(peer: PeerProcess, h: int) -> dict[str, Any]:
        return peer.call("wait", ids=[h])[0]

    # no grant: refused
    res = outcome(a, a.call("write", peer="decode", src=[0], dst=[20], note="no grant"))
    if kind in TWO_SIDED:
        assert res["state"] == "failed" and "grant" in res["error"], res
    _eventually(lambda: b.call("stats")["rejected_grant"] == 1)

    # the grant's own blocks: written, notified under the grant, bound to its user
    g1 = b.call("grant", blocks=[10, 11, 12])
    note = json.dumps({"blocks": [10, 11, 12], "digest": a.call("digest", blocks=[0, 1, 2])})
    res = outcome(a, a.call("write", peer="decode", src=[0, 1, 2], dst=[10, 11, 12], note=note,
                            grant=g1))  # fmt: skip
    assert res["state"] == "done", res
    (ok,) = wait_notes(b, 1)
    assert ok["grant"] == g1 and ok["verified"] and ok["peer"] == "prefill"

    # another trusted peer with the same grant: refused, and the grant ends
    res = outcome(c, c.call("write", peer="decode", src=[5], dst=[10], note="x", grant=g1))
    if kind in TWO_SIDED:
        assert res["state"] == "failed" and "not-holder" in res["error"], res
    violation = wait_notes(b, 2)[1]
    assert violation["kind"] == "violation" and violation["grant"] == g1
    res = outcome(a, a.call("write", peer="decode", src=[0], dst=[10], note="y", grant=g1))
    if kind in TWO_SIDED:
        assert res["state"] == "failed" and "unknown-grant" in res["error"], res

    # a write reaching past its grant: refused, announced
    g2 = b.call("grant", blocks=[30, 31])
    res = outcome(a, a.call("write", peer="decode", src=[3, 4], dst=[30, 40], note="z", grant=g2))
    if kind in TWO_SIDED:
        assert res["state"] == "failed" and "outside-grant" in res["error"], res
    violation = wait_notes(b, 3)[2]
    assert violation["kind"] == "violation" and violation["grant"] == g2

    # a bare notice under a grant: only from its first user
    g3 = b.call("grant", blocks=[50])
    assert outcome(a, a.call("notify", peer="decode", payload="done", grant=g3))["state"] == "done"
    outcome(c, c.call("notify", peer="decode", payload="forged", grant=g3))
    notes = wait_notes(b, 5)
    assert (notes[3]["kind"], notes[3]["grant"], notes[3]["peer"]) == ("notify", g3, "prefill")
    assert (notes[4]["kind"], notes[4]["grant"]) == ("violation", g3)

    # a revoked grant is no grant
    g4 = b.call("grant", blocks=[60])
    assert b.call("revoke", grant=g4) is True
    res = outcome(a, a.call("write", peer="decode", src=[6], dst=[60], note="late", grant=g4))
    if kind in TWO_SIDED:
        assert res["state"] == "failed" and "unknown-grant" in res["error"], res
    time.sleep(0.3)
    assert len(b.call("notes")) == 5  # no refused write was announced as data
    assert b.call("stats")["rejected_grant"] == 6
    if kind in TWO_SIDED:
        assert b.call("digest", blocks=[20, 40]) == before
