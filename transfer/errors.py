"""Exceptions raised by the transfer layer.

Every failure is either raised synchronously (bad arguments, unknown peer, a
descriptor outside a registered region) or recorded on the transfer handle
(peer lost, remote refused). Nothing fails silently.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error raised by `transfer`."""


class BackendUnavailableError(TransferError):
    """The requested backend cannot run here (library missing or unusable)."""


class AgentClosedError(TransferError):
    """The agent was closed; its handles fail with this error."""


class MetadataError(TransferError, ValueError):
    """Agent metadata is malformed, of an unknown version, or inconsistent."""


class LayoutMismatchError(TransferError):
    """A peer's KV layout hash differs from the one the caller expects."""


class DescriptorError(TransferError, ValueError):
    """A descriptor list is malformed or its two sides do not match in size."""


class OutOfBoundsError(DescriptorError):
    """A descriptor reaches outside the region it names, or names no region."""


class UnknownPeerError(TransferError, KeyError):
    """No peer of that name was added with `Agent.add_remote`."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ProtocolError(TransferError):
    """A peer sent bytes that do not follow the wire protocol."""


class PeerError(TransferError):
    """A failure attributed to one remote agent; `peer` names it."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"peer {peer!r}: {message}")
        self.peer = peer


class PeerUnreachableError(PeerError):
    """The peer could not be connected to."""


class PeerDisconnectedError(PeerError):
    """The connection to the peer broke before the transfer completed."""


class PeerRemovedError(PeerError):
    """The peer was removed with `Agent.remove_remote` while work was pending."""


class PeerRestartedError(PeerError):
    """The peer answers with another incarnation than the metadata we hold.

    Refresh its metadata from discovery and call `Agent.add_remote` again.
    """


class PeerRejectedError(PeerError):
    """The peer refused the connection or the transfer; `reason` says why."""

    def __init__(self, peer: str, reason: str, detail: str = "") -> None:
        super().__init__(peer, f"rejected ({reason}){': ' + detail if detail else ''}")
        self.reason = reason


class AuthenticationError(PeerError):
    """The peer could not prove it holds the secret of its metadata."""
