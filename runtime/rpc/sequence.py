"""Checking one worker's event stream: in order, without gaps, from one incarnation.

A worker numbers its KV events 1, 2, 3... per incarnation; a snapshot carries the number
of the last event it includes and a load report the number of the last KV event sent
before it. So a router can tell, from any event, whether it missed or reordered one:
then what it knows of that worker may be wrong, and only a fresh snapshot (a dump) puts
it right. :class:`EventSequencer` is that check, with no I/O: the gRPC client uses it
to resubscribe, the fleet simulator to ask its simulated worker for a dump.
"""

from __future__ import annotations

import enum

from runtime.rpc.types import KvSnapshot, LoadUpdate, WorkerEvent


class Verdict(enum.Enum):
    APPLY = "apply"  # in step: use it
    SKIP = "skip"  # nothing to go on yet (no snapshot since the (re)subscription)
    RESYNC = "resync"  # out of step: discard what is known, get a snapshot


class EventSequencer:
    def __init__(self) -> None:
        self.incarnation: str | None = None
        self.last = -1  # the sequence of the last KV event applied; -1: no snapshot yet

    def reset(self) -> None:
        """A new subscription: wait for its snapshot."""
        self.incarnation, self.last = None, -1

    def check(self, event: WorkerEvent) -> Verdict:
        if isinstance(event, KvSnapshot):
            self.incarnation, self.last = event.incarnation_id, event.sequence
            return Verdict.APPLY
        if self.last < 0:
            return Verdict.SKIP
        if event.incarnation_id != self.incarnation:
            return Verdict.RESYNC  # the worker restarted: its cache is another one
        if isinstance(event, LoadUpdate):
            # it names the last KV event sent before it: any other number is a gap
            return Verdict.APPLY if event.sequence == self.last else Verdict.RESYNC
        if event.sequence != self.last + 1:
            return Verdict.RESYNC
        self.last = event.sequence
        return Verdict.APPLY
