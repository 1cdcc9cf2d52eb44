"""tcp: bytes over one TCP connection per peer pair; works between any hosts.

WRITE: the writer sends one frame (remote ranges, notification, data length)
followed by the data, gathered from the local ranges with `sendmsg`. The
receiver checks the ranges before reading a byte; if they are good it reads
the data with `recvmsg_into` straight into its registered memory (no
intermediate buffer), queues the notification, then ACKs. If they are not, it
discards the data, counts the refusal and NACKs. Transfers to one peer are
pipelined: the writer does not wait for an ACK before sending the next one.

READ: the reader sends the remote ranges; the target checks them and answers
with READ_DATA and the bytes, which the reader lands in its local ranges. A
notification travels in a READ_DONE after the data arrived.

Listens on `host:port` (default 127.0.0.1, an ephemeral port); publish
`advertise_host` when the bind address is not the one peers should dial.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np

from transfer.backends.stream import StreamBackend
from transfer.context import AgentContext, AgentMetadata, Peer
from transfer.errors import ProtocolError
from transfer.handle import Op
from transfer.link import FLAG_PLACED, Frame, FramedSocket, Kind, PeerLink, ServerConn, encode
from transfer.memory import bounce_worthwhile, copy_ranges

CONNECT_TIMEOUT = 5.0


def listen_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def advertised(host: str, advertise_host: str | None) -> str:
    """The address peers should dial for a listener bound to `host`."""
    address = advertise_host or host
    if address in ("0.0.0.0", "::", ""):
        raise ValueError(f"listening on {host!r}: pass advertise_host, the address peers dial")
    return address


def dial_tcp(info: dict[str, Any]) -> socket.socket:
    host, port = info.get("host"), info.get("port")
    if not isinstance(host, str) or not isinstance(port, int):
        raise OSError(f"bad tcp address in metadata: {info}")
    return socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)


class TcpControlled(StreamBackend):
    """A stream backend whose control endpoint is a TCP listener (tcp, ucx): its
    metadata section, under its `kind`, holds the host and port peers dial, and
    whatever else the backend adds (`extra`)."""

    def __init__(
        self, ctx: AgentContext, listener: socket.socket, address: str, **extra: Any
    ) -> None:
        self._address = {"host": address, "port": listener.getsockname()[1], **extra}
        super().__init__(ctx, listener)

    def info(self) -> dict[str, Any]:
        return dict(self._address)

    def reaches(self, md: AgentMetadata) -> bool:
        return self.kind in md.transports

    def _connect(self, peer: Peer) -> socket.socket:
        return dial_tcp(peer.md.transports[self.kind])


class TcpBackend(TcpControlled):
    kind = "tcp"

    def __init__(
        self,
        ctx: AgentContext,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        address = advertised(host, advertise_host)
        super().__init__(ctx, listen_tcp(host, port), address)

    # ---- connecting side ---------------------------------------------------

    def _send_write(self, link: PeerLink, op: Op) -> None:
        assert op.plan is not None
        views = _gathered(self.ctx, op.plan.local)
        op.pins.extend(views)
        xid = link.begin(op)
        head = encode(
            Kind.WRITE,
            xid,
            info=op.info,
            descs=op.plan.remote,
            blob=op.notification,
            data_len=op.plan.nbytes,
        )
        link.socket.send(head, views)

    def _send_read(self, link: PeerLink, op: Op) -> None:
        assert op.plan is not None
        xid = link.begin(op)
        link.socket.send(encode(Kind.READ, xid, descs=op.plan.remote))

    def _on_other_reply(self, link: PeerLink, frame: Frame) -> None:
        if frame.kind != Kind.READ_DATA:
            raise ProtocolError(f"unexpected {frame.kind.name} reply")
        op = link.get(frame.xfer_id)
        assert op.plan is not None
        if op.kind != "read" or frame.data_len != op.plan.nbytes:
            raise ProtocolError(f"READ_DATA of {frame.data_len} bytes does not match the request")
        _recv_scattered(self.ctx, link.socket, op.plan.local)
        link.finish(frame.xfer_id)
        if op.notification is None:
            op.succeed()
        else:  # only the writer thread may send on the link
            link.submit(op, self._send_read_done)

    def _send_read_done(self, link: PeerLink, op: Op) -> None:
        assert op.plan is not None
        xid = link.begin(op)
        link.socket.send(encode(Kind.READ_DONE, xid, descs=op.plan.remote, blob=op.notification))

    # ---- accepting side ----------------------------------------------------

    def _on_write(self, conn: ServerConn, frame: Frame) -> None:
        if frame.flags & FLAG_PLACED or frame.data_len != int(frame.descs[:, 2].sum()):
            raise ProtocolError("tcp WRITE data length does not match its ranges")
        if not self._admit(conn, frame):
            conn.fs.drain(frame.data_len)
            return
        _recv_scattered(self.ctx, conn.fs, frame.descs)
        self.ctx.stats.inc("bytes_received", frame.data_len)
        self._deliver(conn, frame, "write")
        self._ack(conn, frame)

    def _on_read(self, conn: ServerConn, frame: Frame) -> None:
        if not self._admit(conn, frame):
            return
        views = _gathered(self.ctx, frame.descs)
        nbytes = int(frame.descs[:, 2].sum())
        conn.send(encode(Kind.READ_DATA, frame.xfer_id, data_len=nbytes), views)
        for v in views:
            v.release()
        self.ctx.stats.inc("bytes_served", nbytes)

    def _on_read_done(self, conn: ServerConn, frame: Frame) -> None:
        # The bytes were counted when served; only the notification is left.
        if self._admit(conn, frame):
            self._deliver(conn, frame, "read")
            self._ack(conn, frame)


# Many small ranges (a KV head's slice of every row, between pools split over different
# tensor-parallel sizes) cost a memoryview and an iovec each: they go through one
# contiguous buffer instead, gathered or scattered by runs (`memory.copy_ranges`). The
# bytes on the wire are the same either way.


def _gathered(ctx: AgentContext, descs: np.ndarray) -> list[memoryview]:
    """Views of the bytes of `descs`, in order, to send."""
    if not bounce_worthwhile(descs[:, 2]):
        return ctx.regions.views(descs)
    buf = np.empty(int(descs[:, 2].sum()), dtype=np.uint8)
    pins = ctx.regions.pin(descs[:, 0])
    copy_ranges(buf.ctypes.data + _starts(descs), ctx.regions.addresses(descs), descs[:, 2])
    del pins
    return [buf.data]


def _recv_scattered(ctx: AgentContext, fs: FramedSocket, descs: np.ndarray) -> None:
    """Receive the bytes of `descs`, in order, into them."""
    if not bounce_worthwhile(descs[:, 2]):
        fs.recv_into(ctx.regions.views(descs))
        return
    buf = np.empty(int(descs[:, 2].sum()), dtype=np.uint8)
    fs.recv_into([buf.data])
    pins = ctx.regions.pin(descs[:, 0])
    copy_ranges(ctx.regions.addresses(descs), buf.ctypes.data + _starts(descs), descs[:, 2])
    del pins


def _starts(descs: np.ndarray) -> np.ndarray:
    """Each range's offset in the byte stream of the list."""
    starts: np.ndarray = np.concatenate(([0], np.cumsum(descs[:-1, 2]))).astype(np.int64)
    return starts
