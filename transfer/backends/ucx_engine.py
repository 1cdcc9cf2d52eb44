"""A UCX worker driven by one thread: posts tagged sends/receives, reports batches.

ucxx's own progress thread waits on the worker's event fd, but UCX's shared
memory transports raise no events, so an event-driven progress thread can
stall (observed here). This engine runs the worker in blocking mode on its own
thread instead: it spins on `progress()` while requests are in flight and
sleeps in epoll (worker fd + a wake-up pipe) when idle, so an idle agent costs
no CPU. Every UCX call happens on this thread; other threads enqueue commands.

Endpoints use UCX error-handling mode "none" (fastest on loopback and shm);
a dead peer is detected by the tcp control connection instead, and requests
to it are abandoned.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from transfer.errors import BackendUnavailableError

log = logging.getLogger(__name__)
Done = Callable[[BaseException | None], None]
DEFAULT_CONFIG = {"RNDV_FRAG_MEM_TYPE": "host", "MEMTYPE_CACHE": "n"}
_IDLE_POLL_S = 0.5  # asleep in epoll when nothing is in flight
_SPIN_S = 0.005  # busy-poll this long after the last UCX event...
_SLOW_POLL_S = 0.0005  # ...then poll at this period


def _import_ucxx() -> Any:
    """Import ucxx without letting its environment tweaks leak into other UCX users
    (NIXL in the same process reads UCX_* at start-up)."""
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    try:
        import ucxx._lib.libucxx as ucx_api
    except ImportError as e:
        raise BackendUnavailableError(f"ucxx does not import: {e}") from None
    finally:
        for k in [k for k in os.environ if k.startswith("UCX_")]:
            if k not in before:
                del os.environ[k]
            else:
                os.environ[k] = before[k]
    return ucx_api


class _Batch:
    __slots__ = ("done", "i", "owner", "requests", "views")

    def __init__(
        self, owner: str, requests: list[Any], views: list[memoryview], done: Done
    ) -> None:
        self.owner, self.requests, self.views, self.done, self.i = owner, requests, views, done, 0


class UcxEngine:
    def __init__(self, config: dict[str, str] | None = None) -> None:
        self._api = _import_ucxx()
        from ucxx._lib.arr import Array

        self._array = Array
        api = self._api
        self._ctx = api.UCXContext(
            {**DEFAULT_CONFIG, **(config or {})},
            feature_flags=(api.Feature.TAG, api.Feature.WAKEUP),
        )
        self._worker = api.UCXWorker(
            self._ctx, enable_delayed_submission=False, enable_python_future=False
        )
        self._worker.init_blocking_progress_mode()
        self.address: bytes = self._worker.address.tobytes()
        self._eps: dict[str, Any] = {}
        self._batches: list[_Batch] = []
        self._cmds: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ucx-engine", daemon=True)
        self._thread.start()

    # ---- commands (any thread) ----------------------------------------------

    def _submit(self, cmd: Callable[[], None]) -> None:
        if self._closed:
            raise BackendUnavailableError("ucx engine closed")
        self._cmds.put(cmd)
        os.write(self._wake_w, b"x")

    def send(
        self,
        owner: str,
        endpoint: str,
        address: bytes,
        views: list[memoryview],
        tag: int,
        done: Done,
    ) -> None:
        """Send each view as one tagged message to the worker at `address`
        (endpoint cached under the key `endpoint`)."""

        def cmd() -> None:
            try:
                ep = self._endpoint(endpoint, address)
            except Exception as e:
                done(e)
                return
            t = self._api.UCXXTag(tag)
            self._post(owner, lambda v: ep.tag_send(v, t), views, done)

        self._submit(cmd)

    def recv(
        self,
        owner: str,
        views: list[memoryview],
        tag: int,
        done: Done,
        posted: Callable[[], None] | None = None,
    ) -> None:
        """Receive one tagged message into each view, in order; `posted` runs once
        the receives are in place (so the sender's messages arrive expected)."""

        def cmd() -> None:
            t = self._api.UCXXTag(tag)
            self._post(owner, lambda v: self._worker.tag_recv(v, t), views, done)
            if posted is not None:
                posted()

        self._submit(cmd)

    def abandon(self, owner: str) -> None:
        """Stop tracking the requests of `owner` and of ``owner:*`` (their peer is
        gone, or refused them); their callbacks never run."""

        def cmd() -> None:
            self._batches = [
                b for b in self._batches if b.owner != owner and not b.owner.startswith(owner + ":")
            ]

        self._submit(cmd)

    def drop_endpoint(self, endpoint: str) -> None:
        self._submit(lambda: self._eps.pop(endpoint, None) and None)

    # ---- engine thread --------------------------------------------------------

    def _endpoint(self, key: str, address: bytes) -> Any:
        ep = self._eps.get(key)
        if ep is None:
            addr = self._api.UCXAddress.create_from_buffer(address)
            ep = self._eps[key] = self._worker.create_endpoint_from_worker_address(addr, False)
        return ep

    def _post(
        self, owner: str, op: Callable[[Any], Any], views: list[memoryview], done: Done
    ) -> None:
        try:
            requests = [op(self._array(v)) for v in views if v.nbytes]
        except Exception as e:
            done(e)
            return
        self._batches.append(_Batch(owner, requests, views, done))

    def _reap(self) -> bool:
        """Complete finished batches; True if any request finished."""
        moved = False
        live = []
        for b in self._batches:
            err: BaseException | None = None
            try:
                while b.i < len(b.requests) and b.requests[b.i].completed:
                    b.requests[b.i].check_error()
                    b.i += 1
                    moved = True
            except Exception as e:
                err = e
            if err is None and b.i < len(b.requests):
                live.append(b)
                continue
            try:
                b.done(err)
            except Exception:
                log.exception("ucx completion callback failed")
        self._batches = live
        return moved

    def _run(self) -> None:
        poller = select.epoll()
        poller.register(self._worker.epoll_file_descriptor, select.EPOLLIN)
        poller.register(self._wake_r, select.EPOLLIN)
        last_moved = time.monotonic()
        try:
            while True:
                while True:
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        break
                    if cmd is None:
                        return
                    cmd()
                moved = False
                while self._worker.progress_once():  # any UCX event, e.g. a fragment
                    moved = True
                if self._batches:
                    now = time.monotonic()
                    if self._reap() or moved:
                        last_moved = now
                    if now - last_moved < _SPIN_S:
                        os.sched_yield()  # spin, but let other threads and processes run
                    else:  # a slow or silent peer: poll gently instead of burning a core
                        poller.poll(_SLOW_POLL_S)
                        self._drain_wake()
                    continue
                last_moved = time.monotonic()
                if self._worker.arm():
                    poller.poll(_IDLE_POLL_S)
                    self._drain_wake()
        except Exception:
            log.exception("ucx engine stopped")
        finally:
            poller.close()
            for b in self._batches:
                b.done(BackendUnavailableError("ucx engine stopped"))
            self._batches = []

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._cmds.put(None)
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        try:
            self._worker.cancel_inflight_requests()
        except Exception as e:
            log.debug("cancel_inflight_requests: %s", e)
        self._eps.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)
