"""Write grants: which peer may write which bytes of a guarded region, until when.

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
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np

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
