"""The backend interface, and the operation object backends complete.

The agent validates every operation before a backend sees it: the peer is
known, the local ranges lie inside local regions, the remote ranges inside the
regions the peer advertised, and both sides have the same size. A backend then
moves the bytes and completes `Op.handle` exactly once.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transfer.context import AgentContext, AgentMetadata, Peer
from transfer.descriptors import Plan
from transfer.errors import PeerError
from transfer.handle import TransferHandle
from transfer.memory import Region

_BYTES_COUNTER = {"write": "bytes_written", "read": "bytes_read", "notify": None}


@dataclass(eq=False)
class Op:
    """One WRITE, READ or bare notification towards `peer`."""

    kind: str
    peer: Peer
    plan: Plan | None
    notification: bytes | None
    handle: TransferHandle
    ctx: AgentContext
    xfer_id: int = 0
    grant: str | None = None  # the receiver's write grant it uses (transfer/context.py)
    pins: list[Any] = field(default_factory=list)  # views keeping memory mapped
    extra: dict[str, Any] = field(default_factory=dict)  # backend scratch space

    @property
    def nbytes(self) -> int:
        return 0 if self.plan is None else self.plan.nbytes

    @property
    def info(self) -> dict[str, Any] | None:
        """The frame info a stream backend sends with it."""
        return None if self.grant is None else {"grant": self.grant}

    def succeed(self) -> None:
        # counted before the handle wakes its waiters: one that reads stats sees them
        self.handle.set_done(self._count_done)
        self._release()

    def fail(self, error: BaseException) -> None:
        self.handle.set_failed(error, lambda: self.ctx.stats.inc("transfers_failed"))
        self._release()

    def _count_done(self) -> None:
        self.ctx.stats.inc("transfers_done")
        counter = _BYTES_COUNTER[self.kind]
        if counter:
            self.ctx.stats.inc(counter, self.nbytes)

    def _release(self) -> None:
        # Unpin now rather than at garbage collection, so a closing agent can unmap;
        # a view another thread still exports (a sendmsg returning) unpins later.
        for p in self.pins:
            if isinstance(p, memoryview):
                with contextlib.suppress(BufferError):
                    p.release()
        self.pins.clear()
        self.extra.clear()


class Backend(ABC):
    """Moves bytes for one agent over one kind of transport."""

    kind: ClassVar[str]
    #: True when regions in device (GPU) memory can be sources and targets.
    device_memory: ClassVar[bool] = False
    #: True when the receiver can refuse a transfer before its bytes land
    #: (two-sided); False for one-sided RDMA-like backends, where the sender's
    #: check against the advertised regions is what keeps bytes in bounds.
    two_sided: ClassVar[bool] = True

    def __init__(self, ctx: AgentContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def info(self) -> dict[str, Any]:
        """This backend's section of the agent metadata (addresses, keys)."""

    def region_info(self, region: Region) -> dict[str, Any]:
        """Per-region fields this backend needs published (e.g. a segment name)."""
        return {}

    def region_added(self, region: Region) -> None:  # noqa: B027 - optional hook
        """Called after `region` was registered with the agent."""

    def region_removed(self, region: Region) -> None:  # noqa: B027 - optional hook
        """Called before `region` is released."""

    @abstractmethod
    def reaches(self, md: AgentMetadata) -> bool:
        """Whether this backend can talk to the agent described by `md`."""

    def check(self, op: Op) -> None:  # noqa: B027 - optional hook
        """Backend-specific validation at post time; raise to refuse the op."""

    def peer_added(self, peer: Peer) -> None:  # noqa: B027 - optional hook
        """Called when `peer` was added (or replaced an older incarnation)."""

    @abstractmethod
    def peer_removed(self, peer: Peer, error: PeerError) -> None:
        """Drop every cached state of `peer`; fail its pending ops with `error`."""

    @abstractmethod
    def submit(self, op: Op) -> None:
        """Start `op`; never blocks for long; completes `op.handle` later."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads, close connections, fail whatever is still pending."""
