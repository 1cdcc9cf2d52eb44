"""Discovery records as keys and values, and the join/leave/update events they imply."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from protocol.declare import check_name
from runtime.errors import InvalidInput
from runtime.worker_info import WorkerInfo

log = logging.getLogger(__name__)

KEY_ROOT = "/diptych"


def role_prefix(namespace: str, role: str) -> str:
    return f"{KEY_ROOT}/{check_name('namespace', namespace)}/{check_name('role', role)}/"


def worker_key(namespace: str, role: str, worker_id: str) -> str:
    return role_prefix(namespace, role) + worker_id


class EventKind(str, enum.Enum):
    JOIN = "join"
    LEAVE = "leave"
    UPDATE = "update"


@dataclass(frozen=True)
class DiscoveryEvent:
    kind: EventKind
    worker: WorkerInfo  # for LEAVE, the last record seen


def parse_record(key: str, value: bytes) -> WorkerInfo | None:
    try:
        info = WorkerInfo.from_json(value)
    except InvalidInput as e:
        log.warning("ignoring malformed discovery record %s: %s", key, e)
        return None
    if not key.endswith(f"/{info.role}/{info.worker_id}"):
        log.warning("ignoring discovery record %s: it names %s/%s", key, info.role, info.worker_id)
        return None
    return info


def parse_records(data: dict[str, bytes]) -> dict[str, WorkerInfo]:
    out = {}
    for key, value in data.items():
        info = parse_record(key, value)
        if info is not None:
            out[info.worker_id] = info
    return out


def apply_change(
    known: dict[str, WorkerInfo], worker_id: str, new: WorkerInfo | None
) -> list[DiscoveryEvent]:
    """Update ``known`` for one key and return the events that change means."""
    old = known.get(worker_id)
    if new is None:
        if old is None:
            return []
        del known[worker_id]
        return [DiscoveryEvent(EventKind.LEAVE, old)]
    known[worker_id] = new
    if old is None:
        return [DiscoveryEvent(EventKind.JOIN, new)]
    if old.incarnation_id != new.incarnation_id:  # restarted: its caches and streams died
        return [DiscoveryEvent(EventKind.LEAVE, old), DiscoveryEvent(EventKind.JOIN, new)]
    if old != new:
        return [DiscoveryEvent(EventKind.UPDATE, new)]
    return []


def diff_members(
    known: dict[str, WorkerInfo], current: dict[str, WorkerInfo]
) -> list[DiscoveryEvent]:
    events: list[DiscoveryEvent] = []
    scratch = dict(known)
    for worker_id in sorted(set(known) - set(current)):
        events += apply_change(scratch, worker_id, None)
    for worker_id in sorted(current):
        events += apply_change(scratch, worker_id, current[worker_id])
    return events
