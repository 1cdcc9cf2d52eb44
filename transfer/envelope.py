"""Signed notifications for one-sided backends (nixl).

A NIXL notification arrives tagged with whatever agent name the sender chose,
so it proves nothing. We wrap the caller's payload in an envelope the receiver
can verify before delivering it::

    b"DPT2" | u16 name_len | name | incarnation (32 ascii hex) | u8 kind
    | u64 seq | u64 nbytes | u32 n_extents | n x (region, lo, hi) int64
    | u8 grant_len | grant | payload | HMAC-SHA256(sender secret, everything before it)

`extents` are, per remote region touched, the lowest and highest byte of the
transfer, so the receiver re-checks the bounds (and counts a violation) even
though it could not stop the bytes. A transfer under a write grant
(`transfer/context.py`) carries the grant's id and, as its extents, every range it
wrote, which the receiver checks against the grant. `seq` increases per sender incarnation;
NIXL may deliver notifications of concurrent transfers out of order, so the
receiver keeps a sliding window of seen numbers (as IPsec does) to refuse a
replay without refusing a late arrival.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

import numpy as np

from transfer.auth import keyed
from transfer.context import AgentContext, Peer
from transfer.errors import ProtocolError

MAGIC = b"DPT2"
KINDS = ("write", "read", "notify")
_HEAD = struct.Struct("<BQQI")
_MAC = 32
REPLAY_WINDOW = 1 << 16


@dataclass(frozen=True)
class Envelope:
    name: str
    incarnation: str
    kind: str
    seq: int
    nbytes: int
    extents: np.ndarray  # (n, 3) int64: region, first byte, end
    payload: bytes
    grant: str = ""


def ranges(descs: np.ndarray) -> np.ndarray:
    """Every (region, offset, length) row as (region, first byte, end)."""
    out = np.array(descs, dtype=np.int64).reshape(-1, 3)
    out[:, 2] += out[:, 1]
    return out


def extents(descs: np.ndarray) -> np.ndarray:
    """Per region: (region, min offset, max end) of the (n, 3) ranges."""
    if len(descs) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    regions = np.unique(descs[:, 0])
    out = np.empty((len(regions), 3), dtype=np.int64)
    for i, r in enumerate(regions.tolist()):
        rows = descs[descs[:, 0] == r]
        out[i] = (r, rows[:, 1].min(), (rows[:, 1] + rows[:, 2]).max())
    return out


def seal(secret: bytes, env: Envelope) -> bytes:
    name = env.name.encode()
    body = b"".join(
        (
            MAGIC,
            struct.pack("<H", len(name)),
            name,
            env.incarnation.encode("ascii"),
            _HEAD.pack(KINDS.index(env.kind), env.seq, env.nbytes, len(env.extents)),
            env.extents.astype("<i8").tobytes(),
            struct.pack("<B", len(env.grant)),
            env.grant.encode("ascii"),
            env.payload,
        )
    )
    return body + hmac.new(keyed(secret), body, hashlib.sha256).digest()


def peek_sender(data: bytes) -> tuple[str, str]:
    """(name, incarnation) claimed by an envelope, before its signature is checked."""
    if len(data) < 6 + 32 + _HEAD.size + _MAC or data[:4] != MAGIC:
        raise ProtocolError("not a diptych notification")
    (n,) = struct.unpack_from("<H", data, 4)
    try:
        name = data[6 : 6 + n].decode()
        inc = data[6 + n : 38 + n].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("bad notification sender") from None
    return name, inc


def open_sealed(secret: bytes, data: bytes) -> Envelope | None:
    """The envelope if its signature verifies with `secret`, else None."""
    name, inc = peek_sender(data)
    body, mac = data[:-_MAC], data[-_MAC:]
    if not hmac.compare_digest(hmac.new(keyed(secret), body, hashlib.sha256).digest(), mac):
        return None
    pos = 6 + len(name.encode()) + 32
    if len(body) < pos + _HEAD.size:
        raise ProtocolError("truncated notification")
    kind, seq, nbytes, n_ext = _HEAD.unpack_from(body, pos)
    pos += _HEAD.size
    if kind >= len(KINDS) or len(body) < pos + 24 * n_ext:
        raise ProtocolError("malformed notification")
    ext = np.frombuffer(body, dtype="<i8", count=3 * n_ext, offset=pos).astype(np.int64)
    pos += 24 * n_ext
    if len(body) < pos + 1 or len(body) < pos + 1 + body[pos]:
        raise ProtocolError("malformed notification")
    try:
        grant = bytes(body[pos + 1 : pos + 1 + body[pos]]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("malformed notification grant") from None
    payload = bytes(body[pos + 1 + body[pos] :])
    env = Envelope(name, inc, KINDS[kind], seq, nbytes, ext.reshape(n_ext, 3), payload, grant)
    return env


class Gate:
    """Receiver-side checks of incoming envelopes; counts every refusal."""

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx
        self._seen: dict[tuple[str, str], tuple[int, set[int]]] = {}

    def admit(self, transport_sender: str | None, data: bytes) -> tuple[Peer, Envelope] | None:
        """The sender and envelope if it may be delivered, else None (and counted).

        `transport_sender` is the name the transport attached (nixl: the NIXL
        agent name), which must match ``<name>/<incarnation>`` of the envelope.
        """
        stats = self.ctx.stats
        try:
            name, inc = peek_sender(data)
            if transport_sender is not None and transport_sender != f"{name}/{inc}":
                raise ProtocolError("transport sender and envelope disagree")
            peer = self.ctx.peers.lookup(name)
            if peer is None or peer.incarnation != inc:
                stats.inc("rejected_unknown_peer" if peer is None else "rejected_stale_peer")
                return None
            env = open_sealed(peer.md.secret, data)
        except ProtocolError:
            stats.inc("rejected_malformed")
            return None
        if env is None:
            stats.inc("rejected_auth")
            return None
        if not self._fresh((name, inc), env.seq):
            stats.inc("rejected_duplicate")
            return None
        spans = env.extents.copy()
        spans[:, 2] -= spans[:, 1]
        if len(spans) and self.ctx.regions.violation(spans) is not None:
            stats.inc("rejected_out_of_bounds")
            return None
        writes = env.kind in ("write", "notify")
        if writes and self.ctx.admit_grant(peer, env.grant or None, spans) is not None:
            return None
        return peer, env

    def _fresh(self, sender: tuple[str, str], seq: int) -> bool:
        high, seen = self._seen.get(sender, (0, set()))
        if seq <= high - REPLAY_WINDOW or seq in seen:
            return False
        seen.add(seq)
        if seq > high:
            high = seq
            if len(seen) > 2 * REPLAY_WINDOW:
                seen = {s for s in seen if s > high - REPLAY_WINDOW}
        self._seen[sender] = (high, seen)
        return True
