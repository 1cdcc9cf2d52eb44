"""The backend interface (the operation object backends complete, `Op`, lives beside
the handle it completes: transfer/handle.py).

The agent validates every operation before a backend sees it: the peer is
known, the local ranges lie inside local regions, the remote ranges inside the
regions the peer advertised, and both sides have the same size. A backend then
moves the bytes and completes `Op.handle` exactly once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from transfer.context import AgentContext, AgentMetadata, Peer
from transfer.errors import PeerError
from transfer.handle import Op
from transfer.memory import Region


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
