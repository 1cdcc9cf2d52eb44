"""Our connection to one peer: a writer thread for jobs, a reader thread for replies.

Only the writer thread writes to the socket, so a large payload never
deadlocks against replies; it connects (and authenticates, `transfer.handshake`)
lazily, before the first job and again after a failure. When the connection
breaks, every operation pending on it fails with `PeerDisconnectedError` at
once; the next job reconnects and learns from the handshake whether the peer
restarted.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer import handshake
from transfer.backends.base import Op
from transfer.context import AgentContext, Peer
from transfer.control import HANDSHAKE_TIMEOUT
from transfer.errors import (
    AgentClosedError,
    PeerDisconnectedError,
    PeerError,
    PeerUnreachableError,
    ProtocolError,
    TransferError,
)
from transfer.wire import Frame, FramedSocket, tune

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
