"""Wire format of the stream backends (tcp, shm control, ucx control).

Every message is a frame::

    header  <B B H I Q Q>  kind, flags, reserved, meta_len, xfer_id, data_len  (24 bytes)
    meta    <I I I> info_len, blob_len, ndescs, then info (JSON object),
            blob (opaque bytes: a notification), descs (ndescs x 3 little-endian int64)
    data    data_len raw bytes (tcp WRITE and READ_DATA only)

A connection starts with the handshake (HELLO, CHALLENGE, PROOF, WELCOME or
REJECT; see `transfer.control`), then carries requests from the connecting side
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
import os
import socket
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer.errors import ProtocolError

HEADER = struct.Struct("<BBHIQQ")
META = struct.Struct("<III")
MAX_META = 64 << 20
MAX_INFO = 64 << 10
MAX_BLOB = 16 << 20
MAX_DATA = 1 << 44

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
