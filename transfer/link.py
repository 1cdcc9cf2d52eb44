"""The wire of the stream backends (frames, framed sockets) and a connection's two ends:
ours to one peer (`PeerLink`: a writer thread for jobs, a reader thread for replies) and
the accepting side (`ControlServer`: a thread per authenticated connection that reads
its requests in order and hands them to the backend; a request whose transfer id does
not increase is a replay and closes the connection).

Only the writer thread writes to the socket, so a large payload never
deadlocks against replies; it connects (and authenticates, `transfer.handshake`)
lazily, before the first job and again after a failure. When the connection
breaks, every operation pending on it fails with `PeerDisconnectedError` at
once; the next job reconnects and learns from the handshake whether the peer
restarted.

Wire format of the stream backends (tcp, shm control, ucx control).

Every message is a frame::

    header  <B B H I Q Q>  kind, flags, reserved, meta_len, xfer_id, data_len  (24 bytes)
    meta    <I I I> info_len, blob_len, ndescs, then info (JSON object),
            blob (opaque bytes: a notification), descs (ndescs x 3 little-endian int64)
    data    data_len raw bytes (tcp WRITE and READ_DATA only)

A connection starts with the handshake (HELLO, CHALLENGE, PROOF, WELCOME or
REJECT; see `transfer.handshake`), then carries requests from the connecting side
(WRITE, READ, READ_DONE, NOTIFY) and replies from the accepting side (ACK,
NACK, READ_DATA). `xfer_id` increases strictly on a connection.

Limits guard the receiver against a hostile or broken peer: a frame whose
sizes exceed them is a protocol error and closes the connection.

Frames are read and written by blocking I/O on a stream socket (`FramedSocket`), with
scatter/gather payloads going straight between registered memory and the kernel:
`sendmsg` takes the source ranges as an iovec list and `recvmsg_into` lands bytes
directly in the destination ranges, up to IOV_MAX ranges per system call. No
intermediate buffer exists on either side.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from transfer.context import AgentContext, Peer
from transfer.errors import (
    AgentClosedError,
    PeerDisconnectedError,
    PeerError,
    PeerUnreachableError,
    ProtocolError,
    TransferError,
)
from transfer.handle import Op

HEADER = struct.Struct("<BBHIQQ")
META = struct.Struct("<III")
MAX_META = 64 << 20
MAX_INFO = 64 << 10
MAX_BLOB = 16 << 20
MAX_DATA = 1 << 44
HANDSHAKE_TIMEOUT = 10.0

_EMPTY = np.zeros((0, 3), dtype=np.int64)
_LE = np.dtype("<i8")


class Kind(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3
    WELCOME = 4
    REJECT = 5
    WRITE = 10
    READ = 11
    NOTIFY = 12
    READ_DONE = 13
    ACK = 20
    NACK = 21
    READ_DATA = 23


FLAG_NOTIFY = 1  # the blob is a notification to deliver
FLAG_PLACED = 2  # shm: the writer already placed the data; no bytes follow


@dataclass
class Frame:
    kind: Kind
    xfer_id: int = 0
    data_len: int = 0
    flags: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    blob: bytes = b""
    descs: np.ndarray = field(default_factory=lambda: _EMPTY)

    @property
    def notification(self) -> bytes | None:
        return self.blob if self.flags & FLAG_NOTIFY else None


def encode(
    kind: Kind,
    xfer_id: int = 0,
    *,
    info: dict[str, Any] | None = None,
    blob: bytes | None = None,
    descs: np.ndarray | None = None,
    data_len: int = 0,
    flags: int = 0,
) -> bytes:
    """Header and meta of one frame; data, if any, is sent after it."""
    info_b = json.dumps(info, separators=(",", ":")).encode() if info else b""
    blob_b = b"" if blob is None else bytes(blob)
    if blob is not None and kind in (Kind.WRITE, Kind.READ, Kind.READ_DONE, Kind.NOTIFY):
        flags |= FLAG_NOTIFY
    if len(blob_b) > MAX_BLOB:
        raise ValueError(f"notification of {len(blob_b)} bytes exceeds {MAX_BLOB}")
    d = _EMPTY if descs is None else descs
    d_b = d.astype(_LE, copy=False).tobytes()
    meta_len = META.size + len(info_b) + len(blob_b) + len(d_b)
    return b"".join(
        (
            HEADER.pack(kind, flags, 0, meta_len, xfer_id, data_len),
            META.pack(len(info_b), len(blob_b), len(d)),
            info_b,
            blob_b,
            d_b,
        )
    )


def decode_header(buf: bytes | bytearray | memoryview) -> tuple[Kind, int, int, int, int]:
    kind, flags, _, meta_len, xfer_id, data_len = HEADER.unpack(buf)
    try:
        k = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if not META.size <= meta_len <= MAX_META or data_len > MAX_DATA:
        raise ProtocolError(f"frame sizes out of range (meta {meta_len}, data {data_len})")
    return k, flags, meta_len, xfer_id, data_len


def decode_meta(kind: Kind, flags: int, xfer_id: int, data_len: int, meta: bytes) -> Frame:
    if len(meta) < META.size:
        raise ProtocolError("frame meta too short")
    info_len, blob_len, ndescs = META.unpack_from(meta)
    if info_len > MAX_INFO or blob_len > MAX_BLOB:
        raise ProtocolError("frame info or blob too large")
    if META.size + info_len + blob_len + 24 * ndescs != len(meta):
        raise ProtocolError("frame meta sizes do not add up")
    pos = META.size
    info: dict[str, Any] = {}
    if info_len:
        try:
            info = json.loads(meta[pos : pos + info_len])
        except ValueError:
            raise ProtocolError("frame info is not JSON") from None
        if not isinstance(info, dict):
            raise ProtocolError("frame info is not a JSON object")
    pos += info_len
    blob = bytes(meta[pos : pos + blob_len])
    pos += blob_len
    descs = np.frombuffer(meta, dtype=_LE, count=3 * ndescs, offset=pos).astype(np.int64)
    return Frame(kind, xfer_id, data_len, flags, info, blob, descs.reshape(ndescs, 3))


try:
    IOV_MAX = min(int(os.sysconf("SC_IOV_MAX")), 1024)
except (ValueError, OSError):
    IOV_MAX = 1024
_DRAIN = 1 << 20


class FramedSocket:
    """One connected socket. Sends are serialised by a lock; receives must come
    from a single thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, head: bytes, payload: Sequence[memoryview] = ()) -> None:
        with self._send_lock:
            if not payload:
                self.sock.sendall(head)
            else:
                _sendmsg_all(self.sock, [memoryview(head), *payload])

    def recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            got += k
        return buf

    def recv_frame(self) -> Frame:
        kind, flags, meta_len, xfer_id, data_len = decode_header(self.recv_exact(HEADER.size))
        meta = bytes(self.recv_exact(meta_len))
        return decode_meta(kind, flags, xfer_id, data_len, meta)

    def recv_into(self, views: list[memoryview]) -> None:
        """Fill every view, in order."""
        views = [v for v in views if v.nbytes]
        i = 0
        while i < len(views):
            n = self.sock.recvmsg_into(views[i : i + IOV_MAX])[0]
            if n == 0:
                raise ConnectionError("peer closed the connection mid-transfer")
            i = _advance(views, i, n)

    def drain(self, nbytes: int) -> None:
        """Read and discard `nbytes` (a refused transfer's data)."""
        scratch = memoryview(bytearray(min(nbytes, _DRAIN)))
        while nbytes:
            k = self.sock.recv_into(scratch[: min(nbytes, len(scratch))])
            if k == 0:
                raise ConnectionError("peer closed the connection")
            nbytes -= k

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    views = [v for v in views if v.nbytes]
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i : i + IOV_MAX]))


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Consume `n` bytes from views[i:]; returns the first index not fully done."""
    while n:
        size = views[i].nbytes
        if n >= size:
            n -= size
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def tune(sock: socket.socket) -> None:
    """Low latency for small frames and dead-peer detection on idle connections."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


log = logging.getLogger(__name__)

Job = Callable[["PeerLink", Op], None]


@dataclass(eq=False, repr=False)
class PeerLink:
    """Our connection to one peer; reconnects lazily after a failure."""

    ctx: AgentContext
    peer: Peer
    transport: str
    _connect: Callable[[], socket.socket]
    _on_reply: Callable[[PeerLink, Frame], None]
    _on_broken: Callable[[PeerLink], None] | None = None
    fs: FramedSocket | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, Op] = {}
        self._next_id = 0
        self._closed = False
        self._close_error: PeerError | AgentClosedError = AgentClosedError("agent closed")
        self._jobs: queue.SimpleQueue[tuple[Op, Job] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._write_loop, name=f"link-{self.peer.name}", daemon=True
        )
        self._writer.start()

    def submit(self, op: Op, job: Job) -> None:
        """Run `job(link, op)` on the writer thread, after the jobs before it."""
        if self._closed:
            op.fail(self._close_error)
            return
        self._jobs.put((op, job))

    def begin(self, op: Op) -> int:
        """Give `op` a transfer id and track it until `finish`; call before sending."""
        op.xfer_id = self.next_id()
        with self._lock:
            self._pending[op.xfer_id] = op
        return op.xfer_id

    def next_id(self) -> int:
        """A fresh transfer id; alone, for a request that expects no reply (shm's
        placed WRITE)."""
        with self._lock:
            self._next_id += 1
            return self._next_id

    def get(self, xfer_id: int) -> Op:
        op = self._pending.get(xfer_id)
        if op is None:
            raise ProtocolError(f"reply for unknown transfer {xfer_id}")
        return op

    def finish(self, xfer_id: int) -> Op:
        with self._lock:
            op = self._pending.pop(xfer_id, None)
        if op is None:
            raise ProtocolError(f"reply for unknown transfer {xfer_id}")
        return op

    @property
    def socket(self) -> FramedSocket:
        fs = self.fs
        if fs is None:
            raise PeerDisconnectedError(self.peer.name, "connection lost")
        return fs

    def _write_loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            op, job = item
            if self._closed:
                op.fail(self._close_error)
                continue
            try:
                self._ensure_connected()
                job(self, op)
            except TransferError as e:  # PeerError, or a refusal such as a bad mapping
                self._drop(op)
                op.fail(e)
            except (OSError, ConnectionError) as e:
                self._drop(op)
                err = PeerDisconnectedError(self.peer.name, f"send failed: {e}")
                self._broken(self.fs, err)
                op.fail(err)
            except Exception as e:  # a bug must fail the op, not kill the thread
                log.exception("%s: %s job failed", self.ctx.name, op.kind)
                self._drop(op)
                op.fail(TransferError(f"{op.kind} to {self.peer.name!r} failed: {e!r}"))

    def _drop(self, op: Op) -> None:
        with self._lock:
            self._pending.pop(op.xfer_id, None)

    def _ensure_connected(self) -> None:
        if self.fs is not None:
            return
        try:
            sock = self._connect()
        except OSError as e:
            raise PeerUnreachableError(self.peer.name, f"cannot connect: {e}") from None
        fs = FramedSocket(sock)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            from transfer import handshake  # it speaks the frames defined here

            handshake.client(fs, self.ctx, self.peer, self.transport)
            sock.settimeout(None)
            tune(sock)
        except OSError as e:
            fs.close()
            raise PeerUnreachableError(self.peer.name, f"handshake failed: {e}") from None
        except BaseException:
            fs.close()
            raise
        self.fs = fs
        threading.Thread(
            target=self._read_loop, args=(fs,), name=f"link-{self.peer.name}-rx", daemon=True
        ).start()

    def _read_loop(self, fs: FramedSocket) -> None:
        try:
            while True:
                self._on_reply(self, fs.recv_frame())
        except ProtocolError as e:
            self.ctx.stats.inc("rejected_malformed")
            self._broken(fs, PeerDisconnectedError(self.peer.name, f"protocol error: {e}"))
        except (OSError, ConnectionError) as e:
            self._broken(fs, PeerDisconnectedError(self.peer.name, f"connection lost: {e}"))
        except Exception as e:  # a bug: say so loudly, and do not leave ops hanging
            log.exception("%s: reply handling from %s failed", self.ctx.name, self.peer.name)
            self._broken(fs, PeerDisconnectedError(self.peer.name, f"internal error: {e!r}"))

    def _broken(self, fs: FramedSocket | None, error: PeerError) -> None:
        with self._lock:
            if fs is None or self.fs is not fs:
                pending: dict[int, Op] = {}
            else:
                self.fs = None
                pending, self._pending = self._pending, {}
        if fs is not None and not fs.closed:
            fs.close()
            if not self._closed:
                self.ctx.stats.inc("peers_lost")
                log.info("%s: connection to %s lost: %s", self.ctx.name, self.peer.name, error)
            if self._on_broken is not None:
                self._on_broken(self)
        for op in pending.values():
            op.fail(error)

    def close(self, error: PeerError | AgentClosedError | None = None) -> None:
        """Stop the link; pending and queued ops fail with `error`."""
        if error is not None:
            self._close_error = error
        self._closed = True
        err = self._close_error
        fs = self.fs
        with self._lock:
            self.fs = None
            pending, self._pending = self._pending, {}
        if fs is not None:
            fs.close()
        for op in pending.values():
            op.fail(err)
        self._jobs.put(None)


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
        from transfer import handshake  # it speaks the frames defined here

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
