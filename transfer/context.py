"""State an agent shares with its backends: identity, regions, peers, counters.

Backends run on their own threads; everything here is safe to use from them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from transfer.errors import UnknownPeerError
from transfer.grants import GrantTable
from transfer.handle import Notification, NotificationQueue
from transfer.memory import RegionTable
from transfer.metadata import AgentMetadata

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
        so that its owner settles the reservation (`transfer/grants.py`)."""
        refusal = self.grants.check(grant, (peer.name, peer.incarnation), descs)
        if refusal is None:
            return None
        self.stats.inc("rejected_grant")
        if refusal in ("not-holder", "outside-grant") and isinstance(grant, str):
            self.notifications.put(
                Notification(peer.name, peer.incarnation, refusal.encode(), "violation", 0, grant)
            )
        return refusal
