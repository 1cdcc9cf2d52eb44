"""State an agent shares with its backends: identity, regions, peers, write grants,
its published metadata, counters.

Backends run on their own threads; everything here is safe to use from them.

Write grants: which peer may write which bytes of a guarded region, until when.

A receiver guards a region (`Agent.guard`): from then on a WRITE lands in it only
when it presents a grant the receiver issued (`Agent.grant`) and every byte it
touches lies inside the grant's ranges. A grant is a 128-bit random id, a capability
the receiver hands to one writer out of band (the decode worker puts it in the
signed remote-prefill message); the first peer that uses it holds it, and from then
on only that peer (that incarnation) may write with it or send a notification under
it. A grant ends when the receiver revokes it or its time runs out.

A refused use of a live grant also ends the grant, and the receiver hears of it: the
notification queue gets a ``"violation"`` notification carrying the grant id, so the
owner of the reservation can settle it (fall back) at once instead of waiting for a
deadline. Two-sided backends (tcp, ucx) refuse before a byte lands; one-sided ones
(shm, nixl) place the bytes first and the receiver checks the ranges the signed
frame or envelope names, so there a refusal detects, and fails the request, but
cannot undo.

Agent metadata: the self-contained description a peer needs to talk to us.

Published in discovery (etcd) as bytes (`to_bytes`) or embedded in a larger
JSON document (`to_dict`). It names the agent and its incarnation, carries the
agent's secret (peers prove they know the secret of the metadata they were
added with), the transports it serves, its regions with their sizes and an
optional layout hash the caller checks (`Agent.add_remote(expect_layout=...)`).

Example (tcp agent with one 1 MiB region)::

    {"v": 1, "name": "decode-0", "incarnation": "5f0c...", "secret": "9a1e...",
     "backends": ["tcp"], "layout": "c3ab...", "host": "node-7",
     "shm_domain": null,
     "transports": {"tcp": {"host": "10.0.0.7", "port": 41231}},
     "regions": [{"id": 0, "nbytes": 1048576, "device": "cpu"}]}

The metadata changes when regions are registered or removed: register the KV
pool first, then publish.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer.errors import MetadataError, UnknownPeerError
from transfer.handle import Notification, NotificationQueue
from transfer.memory import RegionTable

VERSION = 1
KINDS = ("nixl", "ucx", "shm", "tcp")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_MAX_NAME = 256


def local_shm_domain(shm_dir: str) -> str:
    """Two agents with the same domain can map each other's segments and reach
    each other's abstract Unix sockets: same boot, same tmpfs, same network
    namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    st = os.stat(shm_dir)
    return f"{boot}:{st.st_dev}:{st.st_ino}:{netns}"


@dataclass(frozen=True)
class RegionInfo:
    id: int
    nbytes: int
    device: str = "cpu"
    shm: str | None = None
    address: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "nbytes": self.nbytes, "device": self.device}
        if self.shm is not None:
            d["shm"] = self.shm
        if self.address is not None:
            d["address"] = self.address
        return d


@dataclass(frozen=True)
class AgentMetadata:
    name: str
    incarnation: str
    secret: bytes
    backends: tuple[str, ...]
    transports: dict[str, dict[str, Any]]
    regions: tuple[RegionInfo, ...]
    layout: str | None = None
    host: str = ""
    shm_domain: str | None = None
    sizes: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = np.full(max((r.id for r in self.regions), default=-1) + 1, -1, dtype=np.int64)
        for r in self.regions:
            sizes[r.id] = r.nbytes
        sizes.flags.writeable = False
        object.__setattr__(self, "sizes", sizes)

    def region(self, rid: int) -> RegionInfo:
        for r in self.regions:
            if r.id == rid:
                return r
        raise KeyError(rid)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "name": self.name,
            "incarnation": self.incarnation,
            "secret": self.secret.hex(),
            "backends": list(self.backends),
            "layout": self.layout,
            "host": self.host,
            "shm_domain": self.shm_domain,
            "transports": self.transports,
            "regions": [r.to_dict() for r in self.regions],
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> AgentMetadata:
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise MetadataError(f"agent metadata is not JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Any) -> AgentMetadata:
        if not isinstance(d, dict):
            raise MetadataError("agent metadata must be a JSON object")
        if d.get("v") != VERSION:
            raise MetadataError(f"unsupported agent metadata version {d.get('v')!r}")
        name = _get(d, "name", str)
        if not 0 < len(name) <= _MAX_NAME:
            raise MetadataError(f"agent name must have 1..{_MAX_NAME} characters")
        incarnation = _get(d, "incarnation", str)
        if not _HEX32.match(incarnation):
            raise MetadataError("incarnation must be 32 lowercase hex digits")
        try:
            secret = bytes.fromhex(_get(d, "secret", str))
        except ValueError:
            raise MetadataError("secret must be hex") from None
        if len(secret) < 16:
            raise MetadataError("secret must have at least 16 bytes")
        backends = tuple(_get(d, "backends", list))
        if not backends or any(b not in KINDS for b in backends):
            raise MetadataError(f"backends must be a non-empty subset of {KINDS}, got {backends}")
        transports = _get(d, "transports", dict)
        if any(k not in transports or not isinstance(transports[k], dict) for k in backends):
            raise MetadataError("every listed backend needs an entry in transports")
        regions = tuple(_region(r) for r in _get(d, "regions", list))
        if len({r.id for r in regions}) != len(regions):
            raise MetadataError("region ids must be unique")
        layout = d.get("layout")
        shm_domain = d.get("shm_domain")
        if not isinstance(layout, (str, type(None))) or not isinstance(
            shm_domain, (str, type(None))
        ):
            raise MetadataError("layout and shm_domain must be strings or null")
        return cls(
            name=name,
            incarnation=incarnation,
            secret=secret,
            backends=backends,
            transports=transports,
            regions=regions,
            layout=layout,
            host=str(d.get("host", "")),
            shm_domain=shm_domain,
        )


def _get(d: dict[str, Any], key: str, typ: type) -> Any:
    v = d.get(key)
    if not isinstance(v, typ) or isinstance(v, bool):
        raise MetadataError(f"metadata field {key!r} must be a {typ.__name__}")
    return v


def _region(r: Any) -> RegionInfo:
    if not isinstance(r, dict):
        raise MetadataError("each region must be an object")
    rid, nbytes = _get(r, "id", int), _get(r, "nbytes", int)
    if rid < 0 or rid > 1 << 20 or nbytes <= 0:
        raise MetadataError(f"bad region id {rid} or size {nbytes}")
    shm, address = r.get("shm"), r.get("address")
    if not isinstance(shm, (str, type(None))) or not isinstance(address, (int, type(None))):
        raise MetadataError("region shm must be a string and address an integer")
    return RegionInfo(rid, nbytes, str(r.get("device", "cpu")), shm, address)


GRANT_HEX = 32
REFUSALS = ("no-grant", "unknown-grant", "not-holder", "outside-grant")


@dataclass
class Grant:
    starts: np.ndarray  # merged, sorted [start, end) byte intervals per region
    ends: np.ndarray
    regions: np.ndarray
    expires: float  # time.monotonic()
    holder: tuple[str, str] | None = None


class GrantTable:
    """Issued grants and guarded regions; safe to use from every backend thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._grants: dict[str, Grant] = {}
        self._guarded: set[int] = set()

    def guard(self, region_id: int) -> None:
        with self._lock:
            self._guarded.add(region_id)

    def issue(self, ranges: np.ndarray, ttl_s: float) -> str:
        """A new grant over the (n, 3) ``(region, offset, length)`` rows for ``ttl_s``."""
        if not ttl_s > 0:
            raise ValueError(f"a grant needs a positive lifetime, got {ttl_s!r}")
        regions, starts, ends = _merged(ranges)
        gid = secrets.token_hex(GRANT_HEX // 2)
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            self._grants[gid] = Grant(starts, ends, regions, now + ttl_s)
        return gid

    def revoke(self, grant_id: str) -> bool:
        with self._lock:
            return self._grants.pop(grant_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._grants)

    def check(self, grant_id: object, sender: tuple[str, str], descs: np.ndarray) -> str | None:
        """None if ``sender`` may write the (n, 3) ``descs`` under ``grant_id`` (binding
        the grant to it on first use), else the refusal, one of :data:`REFUSALS`. A
        refused live grant is revoked."""
        with self._lock:
            if grant_id is None or grant_id == "":
                touched = set(np.unique(descs[:, 0]).tolist()) if len(descs) else set()
                return "no-grant" if touched & self._guarded else None
            if not isinstance(grant_id, str):
                return "unknown-grant"
            grant = self._grants.get(grant_id)
            if grant is None or grant.expires < time.monotonic():
                return "unknown-grant"
            if grant.holder is not None and grant.holder != sender:
                reason = "not-holder"
            elif not _inside(grant, descs):
                reason = "outside-grant"
            else:
                grant.holder = sender
                return None
            del self._grants[grant_id]
            return reason

    def _expire(self, now: float) -> None:
        for gid in [g for g, grant in self._grants.items() if grant.expires < now]:
            del self._grants[gid]


def _merged(ranges: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)
    if len(a) == 0:
        raise ValueError("a grant needs at least one range")
    if (a[:, 2] <= 0).any() or (a[:, 1] < 0).any():
        raise ValueError("grant ranges need offsets >= 0 and lengths > 0")
    a = a[np.lexsort((a[:, 1], a[:, 0]))]
    regions, starts, ends = [int(a[0, 0])], [int(a[0, 1])], [int(a[0, 1] + a[0, 2])]
    for r, off, n in a[1:].tolist():
        if r == regions[-1] and off <= ends[-1]:
            ends[-1] = max(ends[-1], off + n)
        else:
            regions.append(r)
            starts.append(off)
            ends.append(off + n)
    return np.array(regions), np.array(starts), np.array(ends)


def _inside(grant: Grant, descs: np.ndarray) -> bool:
    """Whether every row lies within one merged interval of the grant's region."""
    if len(descs) == 0:
        return True
    # intervals are sorted by (region, start): a row's candidate is the last interval
    # whose (region, start) is <= the row's (region, offset)
    keys = grant.regions * (1 << 44) + grant.starts
    rows = descs[:, 0] * (1 << 44) + descs[:, 1]
    i = np.searchsorted(keys, rows, side="right") - 1
    if (i < 0).any():
        return False
    return bool(
        (grant.regions[i] == descs[:, 0]).all()
        and (descs[:, 1] + descs[:, 2] <= grant.ends[i]).all()
    )


# Counters every agent keeps (`Agent.stats()`); a worker exports the failures among
# them as diptych_transfer_failures_total{reason} (worker/metrics.py).
COUNTERS = (
    "writes_posted",
    "reads_posted",
    "notifies_posted",
    "transfers_done",
    "transfers_failed",
    "bytes_written",  # as initiator of WRITE
    "bytes_read",  # as initiator of READ
    "bytes_received",  # landed here from peers' WRITEs
    "bytes_served",  # read from here by peers' READs
    "notifications_delivered",
    "rejected_unknown_peer",  # a peer we never added (or removed) tried to connect or notify
    "rejected_stale_peer",  # a peer with another incarnation than the one we added
    "rejected_auth",  # a peer failed to prove its secret, or a signature did not verify
    "rejected_out_of_bounds",  # a range outside our regions, refused before a byte landed
    "rejected_malformed",  # a frame or notification that breaks the protocol
    "rejected_duplicate",  # a replayed notification
    "rejected_after_placement",  # a peer refused an shm write whose bytes had already landed
    "rejected_grant",  # a write or notice into a guarded region without a fitting grant
    "peers_lost",  # connections to or from a peer that broke
)


class Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(COUNTERS, 0)

    def inc(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._c[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


@dataclass
class Peer:
    """A remote agent we added, with the backend chosen to reach it."""

    md: AgentMetadata
    backend: str
    state: dict[str, object] = field(default_factory=dict)  # per-backend cache

    @property
    def name(self) -> str:
        return self.md.name

    @property
    def incarnation(self) -> str:
        return self.md.incarnation


class PeerTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}

    def put(self, peer: Peer) -> Peer | None:
        """Add or replace; returns the peer it replaced, if any."""
        with self._lock:
            old = self._peers.get(peer.name)
            self._peers[peer.name] = peer
            return old

    def pop(self, name: str) -> Peer | None:
        with self._lock:
            return self._peers.pop(name, None)

    def get(self, name: str) -> Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise UnknownPeerError(f"no peer {name!r}; add its metadata with Agent.add_remote")
        return peer

    def lookup(self, name: str) -> Peer | None:
        return self._peers.get(name)

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers.values()))


class AgentContext:
    """Identity and shared tables of one agent incarnation."""

    def __init__(self, name: str, incarnation: str, secret: bytes, *, shm_dir: str) -> None:
        self.name = name
        self.incarnation = incarnation
        self.secret = secret
        self.shm_dir = shm_dir
        self.regions = RegionTable()
        self.peers = PeerTable()
        self.stats = Stats()
        self.notifications = NotificationQueue()
        self.grants = GrantTable()

    def current_peer(self, name: str, incarnation: str) -> Peer | None:
        """The added peer of that name if it still has that incarnation."""
        peer = self.peers.lookup(name)
        return peer if peer is not None and peer.incarnation == incarnation else None

    def deliver(
        self, peer: Peer, kind: str, payload: bytes, nbytes: int, grant: str | None = None
    ) -> None:
        self.stats.inc("notifications_delivered")
        self.notifications.put(
            Notification(peer.name, peer.incarnation, payload, kind, nbytes, grant)
        )

    def admit_grant(self, peer: Peer, grant: object, descs: np.ndarray) -> str | None:
        """None if `peer` may write `descs` (or notify, with no rows) under `grant`;
        else the refusal, counted, and for a live grant a "violation" notification
        so that its owner settles the reservation (`transfer/context.py`)."""
        refusal = self.grants.check(grant, (peer.name, peer.incarnation), descs)
        if refusal is None:
            return None
        self.stats.inc("rejected_grant")
        if refusal in ("not-holder", "outside-grant") and isinstance(grant, str):
            self.notifications.put(
                Notification(peer.name, peer.incarnation, refusal.encode(), "violation", 0, grant)
            )
        return refusal
