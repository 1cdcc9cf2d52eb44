"""Common core of the backends whose control path is a stream socket (tcp, shm, ucx).

Connecting side: one `PeerLink` per peer; the backend's `_send_write` /
`_send_read` jobs run on the link's writer thread, replies (ACK, NACK,
READ_DATA) arrive on its reader thread.

Accepting side: `ControlServer` authenticates each connection, then
`on_request` checks, for every request, that the peer is still the incarnation
we added and that every range lies inside our regions. A refused request is
answered with NACK and counted; it never touches memory.
"""

from __future__ import annotations

import logging
import socket
import threading
from abc import abstractmethod

from transfer.backends.base import Backend
from transfer.context import AgentContext, Peer
from transfer.errors import AgentClosedError, PeerError, PeerRejectedError, ProtocolError
from transfer.handle import Op
from transfer.link import (
    FLAG_PLACED,
    CloseConnection,
    ControlServer,
    Frame,
    Job,
    Kind,
    PeerLink,
    ServerConn,
    encode,
)

log = logging.getLogger(__name__)


class StreamBackend(Backend):
    def __init__(self, ctx: AgentContext, listener: socket.socket) -> None:
        super().__init__(ctx)
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._server = ControlServer(ctx, self.kind, listener, self)

    # ---- connecting side -------------------------------------------------

    @abstractmethod
    def _connect(self, peer: Peer) -> socket.socket:
        """A connected (not yet authenticated) socket to `peer`'s control endpoint."""

    @abstractmethod
    def _send_write(self, link: PeerLink, op: Op) -> None: ...

    @abstractmethod
    def _send_read(self, link: PeerLink, op: Op) -> None: ...

    def _send_notify(self, link: PeerLink, op: Op) -> None:
        xid = link.begin(op)
        link.socket.send(encode(Kind.NOTIFY, xid, info=op.info, blob=op.notification or b""))

    def submit(self, op: Op) -> None:
        jobs: dict[str, Job] = {
            "write": self._send_write,
            "read": self._send_read,
            "notify": self._send_notify,
        }
        self._link(op.peer).submit(op, jobs[op.kind])

    def _link(self, peer: Peer) -> PeerLink:
        with self._lock:
            if self._closed:
                raise AgentClosedError("agent closed")
            link = self._links.get(peer.name)
            if link is None or link.peer is not peer:
                if link is not None:
                    link.close()
                link = PeerLink(
                    self.ctx,
                    peer,
                    self.kind,
                    lambda: self._connect(peer),
                    self._on_reply,
                    self._link_broken,
                )
                self._links[peer.name] = link
            return link

    def _on_reply(self, link: PeerLink, frame: Frame) -> None:
        if frame.kind == Kind.ACK:
            link.finish(frame.xfer_id).succeed()
        elif frame.kind == Kind.NACK:
            reason = str(frame.info.get("reason", "refused"))
            err = PeerRejectedError(link.peer.name, reason, str(frame.info.get("detail", "")))
            if frame.info.get("placed"):  # an shm write, complete since its bytes landed
                self.ctx.stats.inc("rejected_after_placement")
                log.warning("%s: %s refused a placed write: %s", self.ctx.name, link.peer.name, err)
                return
            link.finish(frame.xfer_id).fail(err)
        else:
            self._on_other_reply(link, frame)

    def _on_other_reply(self, link: PeerLink, frame: Frame) -> None:
        raise ProtocolError(f"unexpected {frame.kind.name} reply")

    def _link_broken(self, link: PeerLink) -> None:
        """Our connection to `link.peer` broke; its pending ops are being failed."""

    # ---- accepting side --------------------------------------------------

    def on_request(self, conn: ServerConn, frame: Frame) -> None:
        if self.ctx.current_peer(conn.peer.name, conn.peer.incarnation) is None:
            stale = self.ctx.peers.lookup(conn.peer.name) is not None
            self.ctx.stats.inc("rejected_stale_peer" if stale else "rejected_unknown_peer")
            self._nack(conn, frame, "stale-peer" if stale else "unknown-peer", "peer was removed")
            raise CloseConnection
        if frame.kind == Kind.WRITE:
            self._on_write(conn, frame)
        elif frame.kind == Kind.READ:
            self._on_read(conn, frame)
        elif frame.kind == Kind.READ_DONE:
            self._on_read_done(conn, frame)
        elif frame.kind == Kind.NOTIFY and frame.notification is not None:
            grant = frame.info.get("grant")
            if grant is not None and not self._granted(conn, frame):
                return
            self.ctx.deliver(conn.peer, "notify", frame.notification, 0, grant)
            self._ack(conn, frame)
        else:
            raise ProtocolError(f"unexpected {frame.kind.name} request")

    @abstractmethod
    def _on_write(self, conn: ServerConn, frame: Frame) -> None: ...

    def _on_read(self, conn: ServerConn, frame: Frame) -> None:
        raise ProtocolError(f"{self.kind} peers do not send READ")

    def _on_read_done(self, conn: ServerConn, frame: Frame) -> None:
        """The peer finished reading `frame.descs` from us: check, count, notify, ACK."""
        if self._admit(conn, frame):
            self.ctx.stats.inc("bytes_served", int(frame.descs[:, 2].sum()))
            self._deliver(conn, frame, "read")
            self._ack(conn, frame)

    def on_conn_closed(self, conn: ServerConn) -> None:
        """A connection from a peer ended (for any reason)."""

    def _admit(self, conn: ServerConn, frame: Frame) -> bool:
        """True if every range of `frame` lies in our regions and, for a WRITE, its
        grant allows them; else NACK and count."""
        reason = self.ctx.regions.violation(frame.descs)
        if reason is not None:
            self.ctx.stats.inc("rejected_out_of_bounds")
            self._nack(conn, frame, "out-of-bounds", reason)
            return False
        return frame.kind != Kind.WRITE or self._granted(conn, frame)

    def _granted(self, conn: ServerConn, frame: Frame) -> bool:
        refusal = self.ctx.admit_grant(conn.peer, frame.info.get("grant"), frame.descs)
        if refusal is None:
            return True
        self._nack(conn, frame, "grant", refusal)
        return False

    def _deliver(self, conn: ServerConn, frame: Frame, kind: str) -> None:
        if frame.notification is not None:
            nbytes = int(frame.descs[:, 2].sum())
            grant = frame.info.get("grant") if kind == "write" else None
            self.ctx.deliver(conn.peer, kind, frame.notification, nbytes, grant)

    @staticmethod
    def _ack(conn: ServerConn, frame: Frame) -> None:
        conn.send(encode(Kind.ACK, frame.xfer_id))

    @staticmethod
    def _nack(conn: ServerConn, frame: Frame, reason: str, detail: str) -> None:
        info: dict[str, object] = {"reason": reason, "detail": detail}
        if frame.flags & FLAG_PLACED:
            info["placed"] = True  # its sender expects no reply: it only logs this one
        conn.send(encode(Kind.NACK, frame.xfer_id, info=info))

    # ---- lifecycle ---------------------------------------------------------

    def peer_removed(self, peer: Peer, error: PeerError) -> None:
        with self._lock:
            link = self._links.pop(peer.name, None)
        if link is not None:
            link.close(error)
        self._server.drop_peer(peer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        self._server.close()
        for link in links:
            link.close()
