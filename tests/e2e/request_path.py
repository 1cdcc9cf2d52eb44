"""Which product files one streamed, disaggregated chat completion runs through, in order.

The frontend, a decode worker and a prefill worker run in this process on the embedded
control plane (the same code `diptych serve` runs as three processes); after one
warm-up request, a profiler notes every file of the repository whose code runs while a
second streamed chat completion is served, in the order each is first entered.

    python -m tests.e2e.request_path     prints the list (docs/architecture.md, "the life
                                         of a request", is this list)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from decode_worker.config import DecodeWorkerConfig
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from frontend.config import FrontendConfig
from frontend.server import FrontendServer
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.worker import PrefillWorker
from tests.loop_thread import LoopThread

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("protocol", "engine", "kernels", "transfer", "runtime", "frontend", "worker",
           "decode_worker", "prefill_worker", "diptych", "planner")  # fmt: skip

# What decides things for a request on the decode side: admission, the local/remote
# choice, the remote-prefill wait, scheduling and block accounting.
DECODE_CONTROL = {
    "decode_worker/worker.py",
    "decode_worker/remote_prefill.py",
    "engine/async_engine.py",
    "engine/engine_core.py",
    "engine/scheduler.py",
    "engine/kv_cache/manager.py",
}


# Loops that run on a timer whatever the requests do (keepalives, membership and queue
# depth polls, deadline sweeps): a file they enter is on the path only if the request
# enters it too, whether or not a tick happens to fall inside the traced request.
TIMER_TASKS = (
    "discovery-keepalive",
    "follow ",
    "frontend-watch",
    "remote prefill deadlines",
    "queue depth",
)


# Set, by the profiler, in a timer loop's context: the work such a loop hands to a thread
# (the state database's reads run on its own thread, in the caller's context) is the
# loop's too.
_TIMER = contextvars.ContextVar("request_path_timer", default=False)


def _on_timer_task() -> bool:
    if _TIMER.get():
        return True
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop on this thread
        return False
    if task is not None and task.get_name().startswith(TIMER_TASKS):
        _TIMER.set(True)  # in the task's own context, which its threads' work copies
        return True
    return False


class FileTrace:
    """Product files entered while `recording`, first entry first, from every thread
    (but not from the timer loops)."""

    def __init__(self) -> None:
        self.recording = False
        self.files: dict[str, None] = {}
        self._other: set[str] = set()  # files outside the product, seen before
        self._root = str(ROOT)

    def _profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        # a call enters a file; its caller runs too (a loop entered before the recording,
        # a socket server's, say, shows itself by what it calls, C functions included)
        if not self.recording:
            # a timer loop is marked before the recording too: its state-database work
            # may start before and run on the database's thread during it
            if event == "call" and frame.f_code.co_filename.startswith(self._root):
                _on_timer_task()
            return
        if event in ("call", "c_call"):
            self._saw(frame.f_code.co_filename)
            if event == "call" and frame.f_back is not None:
                self._saw(frame.f_back.f_code.co_filename)

    def _saw(self, name: str) -> None:
        if name in self._other:
            return
        if name not in self.files and (
            not name.startswith(self._root)
            or Path(name).relative_to(ROOT).parts[0] not in PRODUCT
        ):
            self._other.add(name)
        elif not _on_timer_task():  # (which marks a timer loop's context all the same)
            self.files[name] = None

    def install(self) -> None:
        """Before any thread of the servers starts: threads started later inherit it."""
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def relative(self) -> list[str]:
        return [Path(f).relative_to(ROOT).as_posix() for f in self.files]


def _engine() -> EngineConfig:
    return EngineConfig(dtype="float32", num_blocks=256, max_num_seqs=8)


def _chat(url: str, text: str) -> str:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        return "".join(r.iter_text())


@dataclass
class Fleet:
    """A frontend, a decode worker and a prefill worker in this process."""

    loop: LoopThread
    address: str  # the frontend's host:port
    decode: DecodeWorker
    prefill: PrefillWorker


@contextlib.contextmanager
def in_process_fleet(state_dir: Path, engine: EngineConfig, name: str) -> Iterator[Fleet]:
    """The three roles on the embedded control plane in `state_dir`, the decode worker
    sending prompts over 16 tokens to the prefill worker; stopped on exit."""
    loop = LoopThread(name, timeout=300)
    url = f"embedded:{state_dir}"
    common: dict[str, Any] = {"discovery_url": url, "queue_url": url, "metrics_port": None}
    decode = DecodeWorker(DecodeWorkerConfig(engine=engine, min_remote_prefill_tokens=16, **common))
    prefill = PrefillWorker(PrefillWorkerConfig(engine=engine, **common))
    front = FrontendServer(
        FrontendConfig(discovery_url=url, host="127.0.0.1", port=0, served_model_name="m")
    )
    try:
        loop.run(decode.start())
        loop.run(prefill.start())
        address = loop.run(front.start())
        _wait_for_peers(loop, decode, prefill)
        yield Fleet(loop, address, decode, prefill)
    finally:
        for stop in (front.stop, prefill.stop, decode.stop):
            try:
                loop.run(stop())
            except Exception as e:  # report, keep stopping the rest
                print(f"stopping failed: {e}", file=sys.stderr)
        loop.close()


def trace(state_dir: Path) -> list[str]:
    """Serve a warm-up and a traced request; returns the traced request's files."""
    tracer = FileTrace()
    tracer.install()
    try:
        with in_process_fleet(state_dir, _engine(), "request-path") as fleet:
            text = "Tell me about the sea, the waves, the sand and the wind on the shore. " * 3
            _chat(f"http://{fleet.address}", "Warm up: " + text)
            tracer.recording = True
            out = _chat(f"http://{fleet.address}", text)
            tracer.recording = False
            assert "[DONE]" in out, out[-300:]
            assert fleet.decode.metrics.remote_finished.labels(result="ok")._value.get() == 2
    finally:
        tracer.recording = False
        tracer.uninstall()
    return tracer.relative()


def _wait_for_peers(loop: LoopThread, decode: DecodeWorker, prefill: PrefillWorker) -> None:
    import asyncio

    async def known() -> None:
        for _ in range(400):
            if len(decode.prefill_workers) and len(prefill.decode_workers):
                return
            await asyncio.sleep(0.05)
        raise TimeoutError("the workers did not see each other")

    loop.run(known())


def _numbered(files: list[str]) -> Iterator[str]:
    for i, f in enumerate(files, 1):
        mark = "  (decode-side control)" if f in DECODE_CONTROL else ""
        yield f"{i:2d}. {f}{mark}"


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print("\n".join(_numbered(trace(Path(d)))))
