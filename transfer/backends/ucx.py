"""ucx: UCX tagged messages (ucxx) for the data, a tcp connection for control.

WRITE::

    writer                                    receiver
    WRITE {tag, segment ranges, note} --tcp-> check ranges; then post one tag_recv
    one tag_send per segment --------ucx----> per segment, straight into the KV blocks
                                 <-tcp- ACK   once they complete and the notification
                                              is queued

The writer posts its sends right after the header, so both sides post their
thousands of requests at once (one per range) and no round trip is waited for.
A refused transfer (ranges out of bounds, peer stale) is answered with NACK,
counted, and drained: the receiver posts 16-byte receives with the transfer's
tag, which UCX completes as "truncated" without landing a byte, so the writer's
sends complete and nothing dangles. Each transfer uses a fresh random 64-bit
tag revealed only on the authenticated control connection. READ mirrors it: the
reader posts its receives, then asks; the target checks and sends.

UCX endpoints run with error handling "none" (fastest on loopback); the tcp
control connection is what notices a dead peer, fails its handles at once and
abandons its UCX requests.
"""

from __future__ import annotations

import contextlib
import secrets
import threading

from transfer.backends.tcp import TcpControlled, advertised, listen_tcp
from transfer.backends.ucx_engine import UcxEngine
from transfer.context import AgentContext, Peer
from transfer.errors import PeerDisconnectedError, PeerError, ProtocolError
from transfer.handle import Op
from transfer.link import CloseConnection, Frame, Kind, PeerLink, ServerConn, encode

POST_TIMEOUT = 10.0


def _key(peer: Peer) -> str:
    return f"{peer.name}/{peer.incarnation}"


def _tag(frame: Frame) -> int:
    tag = frame.info.get("tag")
    if not isinstance(tag, int) or not 0 <= tag < 1 << 64:
        raise ProtocolError("ucx request without a valid tag")
    return tag


class UcxBackend(TcpControlled):
    kind = "ucx"

    def __init__(
        self,
        ctx: AgentContext,
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
        *,
        port: int = 0,
        config: dict[str, str] | None = None,
    ) -> None:
        address = advertised(host, advertise_host)
        self.engine = UcxEngine(config)
        try:
            listener = listen_tcp(host, port)
        except OSError:
            self.engine.close()
            raise
        super().__init__(ctx, listener, address, worker=self.engine.address.hex())

    @staticmethod
    def _worker_address(peer: Peer) -> bytes:
        try:
            return bytes.fromhex(peer.md.transports["ucx"]["worker"])
        except (KeyError, TypeError, ValueError):
            raise PeerError(peer.name, "no UCX worker address in its metadata") from None

    # ---- connecting side ---------------------------------------------------

    def _send_write(self, link: PeerLink, op: Op) -> None:
        assert op.plan is not None
        tag = secrets.randbits(64)
        peer = link.peer
        address = self._worker_address(peer)
        fs = link.socket
        xid = link.begin(op)
        owner = f"out:{_key(peer)}:write:{xid}"

        def sent(err: BaseException | None) -> None:
            if err is not None:
                self._abort(link, op, f"UCX send failed: {err}")

        # The header goes first, so the receiver slices its views and posts its
        # receives while we slice ours (thousands of ranges: ~0.7 ms each side).
        fs.send(
            encode(
                Kind.WRITE,
                xid,
                info={"tag": tag, **(op.info or {})},
                descs=op.plan.remote,
                blob=op.notification,
            )
        )
        try:
            views = self.ctx.regions.views(op.plan.local)
            op.pins.extend(views)
            self.engine.send(owner, _key(peer), address, views, tag, sent)
        except BaseException as e:
            # the receiver waits for messages that will not come: end the connection
            # (it abandons its receives) and every op on it
            fs.close()
            raise OSError(f"could not post the UCX sends: {e!r}") from e

    def _abort(self, link: PeerLink, op: Op, why: str) -> None:
        with contextlib.suppress(ProtocolError):  # already finished or failed
            link.finish(op.xfer_id)
        op.fail(PeerDisconnectedError(link.peer.name, why))

    def _send_read(self, link: PeerLink, op: Op) -> None:
        assert op.plan is not None
        tag = secrets.randbits(64)
        views = self.ctx.regions.views(op.plan.local)
        op.pins.extend(views)
        posted = threading.Event()
        xid = link.begin(op)

        def received(err: BaseException | None) -> None:
            if err is not None:
                self._abort(link, op, f"UCX receive failed: {err}")
                return
            try:
                link.finish(xid)
            except ProtocolError:
                return  # failed meanwhile (NACK or disconnect)
            if op.notification is None:
                op.succeed()
            else:
                link.submit(op, self._send_read_done)

        op.extra["owner"] = owner = f"out:{_key(link.peer)}:read:{xid}"
        self.engine.recv(owner, views, tag, received, posted.set)
        if not posted.wait(POST_TIMEOUT):
            raise PeerError(link.peer.name, "UCX engine did not post the receives")
        link.socket.send(encode(Kind.READ, xid, info={"tag": tag}, descs=op.plan.remote))

    def _on_reply(self, link: PeerLink, frame: Frame) -> None:
        owner = None
        if frame.kind == Kind.NACK:  # a refused READ leaves receives posted: forget them
            owner = link.get(frame.xfer_id).extra.get("owner")
        super()._on_reply(link, frame)
        if owner is not None:
            self.engine.abandon(owner)

    def _send_read_done(self, link: PeerLink, op: Op) -> None:
        assert op.plan is not None
        xid = link.begin(op)
        link.socket.send(encode(Kind.READ_DONE, xid, descs=op.plan.remote, blob=op.notification))

    def _link_broken(self, link: PeerLink) -> None:
        self.engine.abandon(f"out:{_key(link.peer)}")
        self.engine.drop_endpoint(_key(link.peer))

    # ---- accepting side ----------------------------------------------------

    @staticmethod
    def _owner(conn: ServerConn) -> str:
        return f"in:{_key(conn.peer)}:{id(conn)}"

    def _on_write(self, conn: ServerConn, frame: Frame) -> None:
        if frame.data_len or frame.flags & ~1:
            raise ProtocolError("ucx WRITE carries no inline data")
        tag = _tag(frame)
        if not self._admit(conn, frame):
            self._drain(conn, tag, len(frame.descs))
            return
        nbytes = int(frame.descs[:, 2].sum())

        def received(err: BaseException | None) -> None:
            if conn.fs.closed:
                return  # the writer is gone: never announce its bytes
            try:
                if err is not None:
                    self._nack(conn, frame, "transfer-failed", str(err))
                    return
                self.ctx.stats.inc("bytes_received", nbytes)
                self._deliver(conn, frame, "write")
                self._ack(conn, frame)
            except OSError:
                pass

        self.engine.recv(self._owner(conn), self.ctx.regions.views(frame.descs), tag, received)

    def _drain(self, conn: ServerConn, tag: int, n: int) -> None:
        """Swallow the `n` messages of a refused WRITE: truncating receives land
        nothing, and complete the writer's sends."""
        sink = memoryview(bytearray(16))
        self.engine.recv(self._owner(conn), [sink] * n, tag, lambda _err: None)

    def on_request(self, conn: ServerConn, frame: Frame) -> None:
        try:
            super().on_request(conn, frame)
        except CloseConnection:
            if frame.kind == Kind.WRITE:  # refused as stale: still drain its data
                with contextlib.suppress(ProtocolError):
                    self._drain(conn, _tag(frame), len(frame.descs))
            raise

    def _on_read(self, conn: ServerConn, frame: Frame) -> None:
        tag = _tag(frame)
        if not self._admit(conn, frame):
            return
        nbytes = int(frame.descs[:, 2].sum())

        def sent(err: BaseException | None) -> None:
            if err is None:
                self.ctx.stats.inc("bytes_served", nbytes)
            elif not conn.fs.closed:
                with contextlib.suppress(OSError):
                    self._nack(conn, frame, "transfer-failed", str(err))

        peer = conn.peer
        views = self.ctx.regions.views(frame.descs)
        self.engine.send(
            self._owner(conn), _key(peer), self._worker_address(peer), views, tag, sent
        )

    def _on_read_done(self, conn: ServerConn, frame: Frame) -> None:
        if self._admit(conn, frame):  # bytes were counted when sent
            self._deliver(conn, frame, "read")
            self._ack(conn, frame)

    def on_conn_closed(self, conn: ServerConn) -> None:
        self.engine.abandon(self._owner(conn))

    # ---- lifecycle -----------------------------------------------------------

    def peer_removed(self, peer: Peer, error: PeerError) -> None:
        super().peer_removed(peer, error)
        self.engine.abandon(f"out:{_key(peer)}")
        self.engine.drop_endpoint(_key(peer))

    def close(self) -> None:
        super().close()
        self.engine.close()
