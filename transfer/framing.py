"""Blocking framed I/O on a stream socket, with scatter/gather payloads.

Payloads go straight between registered memory and the kernel: `sendmsg` takes
the source ranges as an iovec list and `recvmsg_into` lands bytes directly in
the destination ranges, up to IOV_MAX ranges per system call. No intermediate
buffer exists on either side.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Sequence

from transfer.wire import HEADER, Frame, decode_header, decode_meta

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
