"""A hostile or broken peer speaking the wire protocol directly to a receiver."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from transfer import Agent, PeerRejectedError, PeerRestartedError, ProtocolError
from transfer.context import Peer
from transfer.handshake import client
from transfer.link import FLAG_PLACED, Frame, FramedSocket, Kind, encode

POOL = 1 << 16


@pytest.fixture
def receiver() -> Iterator[Agent]:
    with Agent("decode", backend=("shm", "tcp")) as b:
        b.allocate(POOL)
        yield b


def _dial(b: Agent, kind: str) -> FramedSocket:
    info = b.describe().transports[kind]
    if kind == "tcp":
        return FramedSocket(socket.create_connection((info["host"], info["port"]), timeout=5))
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect("\0" + info["socket"])
    return FramedSocket(s)


def _session(b: Agent, kind: str, name: str = "prefill") -> tuple[FramedSocket, Agent]:
    """An authenticated raw connection, as the (added) agent `name`."""
    a = Agent(name, backend="tcp")
    b.add_remote(a.metadata())
    fs = _dial(b, kind)
    client(fs, a._ctx, Peer(b.describe(), kind), kind)
    return fs, a


def _eventually(pred: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_handshake_refusals_are_counted(receiver: Agent, kind: str) -> None:
    b = receiver
    stranger = Agent("stranger", backend="tcp")
    with pytest.raises(PeerRejectedError, match="unknown-peer"):
        client(_dial(b, kind), stranger._ctx, Peer(b.describe(), kind), kind)
    stale = Peer(b.describe(), kind)
    stale.md = type(stale.md).from_dict({**stale.md.to_dict(), "incarnation": "0" * 32})
    b.add_remote(stranger.metadata())
    with pytest.raises(PeerRestartedError):
        client(_dial(b, kind), stranger._ctx, stale, kind)
    fs = _dial(b, kind)
    fs.send(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))  # not our protocol at all
    with pytest.raises((ConnectionError, ProtocolError, OSError)):
        fs.recv_frame()
    impostor = Agent("stranger", backend="tcp")  # right name, wrong secret
    with pytest.raises(PeerRejectedError, match="stale-peer"):
        client(_dial(b, kind), impostor._ctx, Peer(b.describe(), kind), kind)
    ctx = impostor._ctx
    ctx.incarnation = stranger.incarnation  # right name and incarnation, still not the secret
    with pytest.raises(PeerRejectedError, match="auth"):
        client(_dial(b, kind), ctx, Peer(b.describe(), kind), kind)
    _eventually(lambda: b.stats()["rejected_malformed"] == 1)
    s = b.stats()
    assert (s["rejected_unknown_peer"], s["rejected_stale_peer"], s["rejected_auth"]) == (1, 2, 1)
    for agent in (stranger, impostor):
        agent.close()


def test_out_of_bounds_write_is_refused_before_a_byte_lands(receiver: Agent) -> None:
    b = receiver
    fs, a = _session(b, "tcp")
    data = memoryview(np.full(4096, 7, dtype=np.uint8).tobytes())
    oob = np.array([[0, POOL - 100, 4096]], dtype=np.int64)
    fs.send(encode(Kind.WRITE, 1, descs=oob, blob=b"x", data_len=4096), [data])
    reply = fs.recv_frame()
    assert reply.kind == Kind.NACK and reply.info["reason"] == "out-of-bounds"
    assert not b.regions[0].numpy().any()  # drained, never written
    ok = np.array([[0, 0, 4096]], dtype=np.int64)
    fs.send(encode(Kind.WRITE, 2, descs=ok, blob=b"y", data_len=4096), [data])
    assert fs.recv_frame().kind == Kind.ACK  # the connection survived the refusal
    assert (b.regions[0].numpy()[:4096] == 7).all()
    assert [n.payload for n in b.get_notifications()] == [b"y"]
    assert b.stats()["rejected_out_of_bounds"] == 1
    a.close()


def test_shm_receiver_rechecks_placed_writes(receiver: Agent) -> None:
    b = receiver
    fs, a = _session(b, "shm")
    fs.send(encode(Kind.WRITE, 1, flags=FLAG_PLACED, descs=np.array([[5, 0, 8]]), blob=b"x"))
    reply = fs.recv_frame()
    assert reply.kind == Kind.NACK and "unknown region 5" in reply.info["detail"]
    fs.send(encode(Kind.WRITE, 2, descs=np.array([[0, 0, 8]]), data_len=8), [memoryview(bytes(8))])
    with pytest.raises((ConnectionError, OSError, ProtocolError)):
        fs.recv_frame()  # inline data on shm is a protocol violation: closed
    _eventually(lambda: b.stats()["rejected_malformed"] == 1)
    assert b.stats()["rejected_out_of_bounds"] == 1 and b.get_notifications() == []
    a.close()


@pytest.mark.parametrize(
    "frames",
    [
        [encode(Kind.NOTIFY, 3, blob=b"a"), encode(Kind.NOTIFY, 3, blob=b"replayed")],
        [encode(Kind.WRITE, 1, descs=np.array([[0, 0, 8]]), data_len=9)],  # sizes disagree
        [encode(Kind.ACK, 1)],  # a reply where a request belongs
    ],
)
def test_protocol_violations_close_the_connection(receiver: Agent, frames: list[bytes]) -> None:
    b = receiver
    fs, a = _session(b, "tcp")
    for f in frames:
        fs.send(f)
    replies: list[Frame] = []
    with pytest.raises((ConnectionError, OSError, ProtocolError)):
        while True:
            replies.append(fs.recv_frame())
    assert all(r.kind == Kind.ACK for r in replies)
    _eventually(lambda: b.stats()["rejected_malformed"] == 1)
    assert [n.payload for n in b.get_notifications()] == [b"a"][: len(replies)]
    a.close()
