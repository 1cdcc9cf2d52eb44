"""What a prefill worker serves on gRPC: its KV events and load, and its health.

Decode workers subscribe to every prefill worker's Events stream (the same service and
messages a decode worker serves the frontends) to prefer, for a remote prefill, the
prefill worker that holds most of its prompt. A prefill worker takes its work from the
prefill queue: it serves no Generate (a call is UNIMPLEMENTED).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from runtime.rpc.events import KvEventPublisher
from runtime.rpc.handler import WorkerHandler
from runtime.rpc.types import HealthReport, LoadReport, ServingStatus, WorkerEvent


class PrefillEvents(WorkerHandler):
    def __init__(self, publisher: KvEventPublisher, worker_id: str, incarnation_id: str) -> None:
        self.publisher = publisher
        self.worker_id = worker_id
        self.incarnation_id = incarnation_id
        self.draining = False
        self.alive = True
        self.in_flight = 0  # prefills being worked on
        self.prefill_pending = 0  # their prompt tokens not in this worker's cache

    async def health(self) -> HealthReport:
        if not self.alive:
            status = ServingStatus.NOT_SERVING
        elif self.draining:
            status = ServingStatus.DRAINING
        else:
            status = ServingStatus.SERVING
        return HealthReport(status, self.worker_id, self.incarnation_id, load=self.load())

    def events(self) -> AsyncIterator[WorkerEvent]:
        return self.publisher.subscribe()

    def load(self) -> LoadReport:
        return LoadReport(
            active_requests=self.in_flight, prefill_tokens_pending=max(self.prefill_pending, 0)
        )

    def started(self, prefill_tokens: int) -> None:
        self._changed(1, prefill_tokens)

    def finished(self, prefill_tokens: int) -> None:
        self._changed(-1, -prefill_tokens)

    def _changed(self, prefills: int, tokens: int) -> None:
        self.in_flight += prefills
        self.prefill_pending += tokens
        self.publisher.update_load(self.load())
