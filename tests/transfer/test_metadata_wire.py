"""Metadata, wire frames and signed envelopes: the bytes that cross process boundaries."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from transfer import AgentMetadata, MetadataError, ProtocolError, RegionInfo
from transfer.context import AgentContext, Peer
from transfer.envelope import Envelope, Gate, extents, open_sealed, peek_sender, seal
from transfer.link import HEADER, META, Frame, Kind, decode_header, decode_meta, encode
from transfer.memory import Region

INC = "0123456789abcdef0123456789abcdef"


def md(**over: Any) -> AgentMetadata:
    fields: dict[str, Any] = {
        "name": "decode-0",
        "incarnation": INC,
        "secret": b"s" * 32,
        "backends": ("tcp",),
        "transports": {"tcp": {"host": "127.0.0.1", "port": 1}},
        "regions": (RegionInfo(0, 4096), RegionInfo(2, 100, shm="x")),
        "layout": "L",
    }
    fields.update(over)
    return AgentMetadata(**fields)


def test_metadata_round_trips_and_is_json() -> None:
    m = md()
    assert AgentMetadata.from_bytes(m.to_bytes()) == m
    assert AgentMetadata.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert m.sizes.tolist() == [4096, -1, 100]


@pytest.mark.parametrize(
    "patch",
    [
        {"v": 2},
        {"name": ""},
        {"incarnation": "xyz"},
        {"secret": "abcd"},
        {"secret": "zz" * 32},
        {"backends": ["carrier-pigeon"]},
        {"backends": ["tcp", "shm"]},  # shm listed without a transports entry
        {"regions": [{"id": 0, "nbytes": 1}, {"id": 0, "nbytes": 2}]},
        {"regions": [{"id": 0, "nbytes": -5}]},
        {"regions": [{"id": True, "nbytes": 5}]},
        {"layout": 5},
    ],
)
def test_metadata_refuses_malformed_fields(patch: dict[str, Any]) -> None:
    d = md().to_dict()
    d.update(patch)
    with pytest.raises(MetadataError):
        AgentMetadata.from_dict(d)


def test_metadata_refuses_non_json() -> None:
    with pytest.raises(MetadataError):
        AgentMetadata.from_bytes(b"\xff not json")
    with pytest.raises(MetadataError):
        AgentMetadata.from_bytes(b"[1, 2]")


def _decode(raw: bytes) -> Frame:
    kind, flags, meta_len, xid, data_len = decode_header(raw[: HEADER.size])
    assert meta_len == len(raw) - HEADER.size
    return decode_meta(kind, flags, xid, data_len, raw[HEADER.size :])


def test_frames_round_trip() -> None:
    descs = np.array([[0, 8, 16], [3, 0, 4]], dtype=np.int64)
    f = _decode(encode(Kind.WRITE, 7, info={"tag": 5}, blob=b"note", descs=descs, data_len=20))
    assert (f.kind, f.xfer_id, f.data_len, f.info) == (Kind.WRITE, 7, 20, {"tag": 5})
    assert f.notification == b"note" and f.descs.tolist() == descs.tolist()
    # an empty notification is still a notification; no blob means none
    assert _decode(encode(Kind.WRITE, 1, blob=b"")).notification == b""
    assert _decode(encode(Kind.WRITE, 1)).notification is None
    assert _decode(encode(Kind.ACK, 1)).notification is None


def test_frames_refuse_garbage() -> None:
    good = encode(Kind.ACK, 1)
    with pytest.raises(ProtocolError, match="unknown frame kind"):
        decode_header(bytes([99]) + good[1 : HEADER.size])
    with pytest.raises(ProtocolError, match="out of range"):
        decode_header(HEADER.pack(Kind.ACK, 0, 0, 1 << 30, 1, 0))
    meta = bytearray(encode(Kind.WRITE, 1, blob=b"abc")[HEADER.size :])
    with pytest.raises(ProtocolError, match="do not add up"):
        decode_meta(Kind.WRITE, 0, 1, 0, bytes(meta[:-1]))
    with pytest.raises(ProtocolError, match="not a JSON object"):
        decode_meta(Kind.WRITE, 0, 1, 0, META.pack(3, 0, 0) + b"[1]")
    with pytest.raises(ProtocolError, match="too short"):
        decode_meta(Kind.WRITE, 0, 1, 0, b"\0")


def _env(seq: int, ext: list[list[int]] | None = None, kind: str = "write") -> Envelope:
    e = np.array(ext if ext is not None else [[0, 0, 64]], dtype=np.int64).reshape(-1, 3)
    return Envelope("prefill", INC, kind, seq, 64, e, b"hello")


def test_envelopes_are_signed() -> None:
    data = seal(b"k" * 32, _env(1))
    assert peek_sender(data) == ("prefill", INC)
    env = open_sealed(b"k" * 32, data)
    assert env is not None and env.payload == b"hello" and env.extents.tolist() == [[0, 0, 64]]
    assert open_sealed(b"other" * 8, data) is None
    tampered = bytearray(data)
    tampered[-40] ^= 1
    assert open_sealed(b"k" * 32, bytes(tampered)) is None
    with pytest.raises(ProtocolError):
        peek_sender(b"junk")


def test_extents_cover_each_region() -> None:
    d = np.array([[0, 100, 10], [1, 5, 5], [0, 20, 10]], dtype=np.int64)
    assert extents(d).tolist() == [[0, 20, 110], [1, 5, 10]]


def test_gate_delivers_only_fresh_authentic_in_bounds_envelopes_from_added_peers() -> None:
    ctx = AgentContext("decode-0", INC, b"d" * 32, shm_dir="/dev/shm")
    buf = bytearray(4096)
    ctx.regions.add(Region(0, memoryview(buf), 0, 4096))
    secret = b"p" * 32
    gate = Gate(ctx)
    nixl_name = f"prefill/{INC}"

    assert gate.admit(nixl_name, seal(secret, _env(1))) is None  # not added yet
    assert ctx.stats.snapshot()["rejected_unknown_peer"] == 1

    peer_md = md(name="prefill", secret=secret)
    ctx.peers.put(Peer(peer_md, "nixl"))
    admitted = gate.admit(nixl_name, seal(secret, _env(2)))
    assert admitted is not None and admitted[1].payload == b"hello"
    assert gate.admit(nixl_name, seal(secret, _env(4))) is not None
    assert gate.admit(nixl_name, seal(secret, _env(3))) is not None  # late, not replayed
    assert gate.admit(nixl_name, seal(secret, _env(3))) is None  # replayed
    assert gate.admit(nixl_name, seal(b"x" * 32, _env(9))) is None  # forged
    assert gate.admit(nixl_name, seal(secret, _env(10, [[0, 4000, 4097]]))) is None
    assert gate.admit(nixl_name, seal(secret, _env(11, [[1, 0, 1]]))) is None  # no region 1
    assert gate.admit("someone/else", seal(secret, _env(12))) is None
    ctx.peers.put(Peer(md(name="prefill", secret=secret, incarnation="f" * 32), "nixl"))
    assert gate.admit(nixl_name, seal(secret, _env(13))) is None  # an old incarnation
    s = ctx.stats.snapshot()
    assert (s["rejected_duplicate"], s["rejected_auth"], s["rejected_out_of_bounds"]) == (1, 1, 2)
    assert (s["rejected_malformed"], s["rejected_stale_peer"]) == (1, 1)
