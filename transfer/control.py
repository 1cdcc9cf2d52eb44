"""The accepting side of authenticated control connections.

`ControlServer` accepts connections, authenticates each (`transfer.handshake`)
and runs one thread per connection that reads requests, in order, and hands
them to the backend. A request whose transfer id does not increase is a replay
and closes the connection. The connecting side is `transfer.link.PeerLink`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from typing import Any, Protocol

from transfer import handshake
from transfer.context import AgentContext, Peer
from transfer.errors import (
    ProtocolError,
    TransferError,
)
from transfer.link import HANDSHAKE_TIMEOUT, Frame, FramedSocket, tune

log = logging.getLogger(__name__)


class CloseConnection(Exception):
    """Raised by a request handler to close the connection after replying."""


class ServerConn:
    """An authenticated incoming connection from `peer`."""

    def __init__(self, fs: FramedSocket, peer: Peer) -> None:
        self.fs = fs
        self.peer = peer
        self.state: dict[str, Any] = {}

    def send(self, head: bytes, payload: list[memoryview] | None = None) -> None:
        self.fs.send(head, payload or ())


class RequestHandler(Protocol):
    def on_request(self, conn: ServerConn, frame: Frame) -> None: ...

    def on_conn_closed(self, conn: ServerConn) -> None: ...


class ControlServer:
    def __init__(
        self, ctx: AgentContext, transport: str, listener: socket.socket, handler: RequestHandler
    ) -> None:
        self.ctx = ctx
        self.transport = transport
        self.handler = handler
        self._listener = listener
        self._conns: set[ServerConn] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"{transport}-accept", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            threading.Thread(
                target=self._serve, args=(sock,), name=f"{self.transport}-conn", daemon=True
            ).start()

    def _serve(self, sock: socket.socket) -> None:
        fs = FramedSocket(sock)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            peer = handshake.server(fs, self.ctx, self.transport)
            sock.settimeout(None)
            tune(sock)
        except (handshake.Rejected, OSError, ProtocolError) as e:
            if isinstance(e, ProtocolError):
                self.ctx.stats.inc("rejected_malformed")
            fs.close()
            return
        conn = ServerConn(fs, peer)
        with self._lock:
            if self._closed:
                fs.close()
                return
            self._conns.add(conn)
        last = 0
        try:
            while True:
                frame = fs.recv_frame()
                if frame.xfer_id <= last:
                    self.ctx.stats.inc("rejected_duplicate")
                    raise ProtocolError(f"transfer id {frame.xfer_id} not above {last}")
                last = frame.xfer_id
                self.handler.on_request(conn, frame)
        except CloseConnection:
            pass
        except ProtocolError as e:
            self.ctx.stats.inc("rejected_malformed")
            log.warning("%s: closing connection from %s: %s", self.ctx.name, peer.name, e)
        except (OSError, ConnectionError, TransferError) as e:
            if not fs.closed:
                self.ctx.stats.inc("peers_lost")
                log.info("%s: connection from %s lost: %s", self.ctx.name, peer.name, e)
        except Exception:  # a bug: say so loudly; the connection closes below
            log.exception("%s: request handling for %s failed", self.ctx.name, peer.name)
        finally:
            fs.close()
            with self._lock:
                self._conns.discard(conn)
            self.handler.on_conn_closed(conn)

    def drop_peer(self, peer: Peer) -> None:
        """Close every connection from this incarnation of `peer` (removed or replaced)."""
        with self._lock:
            conns = [c for c in self._conns if c.peer is peer]
        for c in conns:
            c.fs.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for c in conns:
            c.fs.close()
        self._thread.join(timeout=5)
