"""`diptych serve` as a real process tree, for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.servers import scrape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """Start with `diptych serve <flags>`; `.url`, `.manifest`, `.metrics(role)`, `.stop()`."""

    def __init__(self, state_dir: Path, *flags: str, startup_timeout: float = 300) -> None:
        # free_port() only finds a port free now: another test's server may take it before
        # this one binds it (the suite runs tests in parallel). That start fails with
        # "Address already in use", and only that failure is tried again, on another port.
        for attempt in range(3):
            try:  # (a retry in a state directory of its own: none of the first's records)
                self._start(state_dir / f"retry-{attempt}" if attempt else state_dir, flags,
                            startup_timeout)  # fmt: skip
                return
            except RuntimeError as e:
                if attempt == 2 or "Address already in use" not in str(e):
                    raise

    def _start(self, state_dir: Path, flags: tuple[str, ...], startup_timeout: float) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "diptych.cli", "serve",
            "--port", str(self.port), "--state-dir", str(state_dir), *flags,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        end = time.monotonic() + startup_timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError("diptych serve did not start:\n" + "".join(self.log[-40:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("Diptych is serving"):
                self._ready.set()

    @property
    def manifest(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.state_dir / "serve.json").read_text())
        return doc

    def metrics(self, child: str) -> dict[str, float]:
        """Prometheus samples of one child (e.g. "decode-0"), name{labels} -> value."""
        return scrape(f"http://{self.manifest[child]['metrics']}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


# prompts whose greedy answers run long (streams that are still under way at a kill)
STREAM_PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain, step by step, how bread is made at home.",
    "Describe a walk through a busy market in the morning.",
    "List the things a traveller should pack for a week in the mountains.",
]


def greedy_stream(client: Any, prompt: str, max_tokens: int, progress: list[int], i: int
                  ) -> tuple[str, str]:  # fmt: skip
    """One streamed greedy chat through the openai client: (text, finish reason); each
    chunk counts in `progress[i]`."""
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, finish = "", ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            progress[i] += 1
    return text, finish


def offline_greedy_chats(model: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy chat text from the engine in this process (TP 1, fp32)."""
    from engine.config import EngineConfig
    from engine.llm import LLM
    from protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with LLM.from_config(EngineConfig(model=str(model), dtype="float32", num_blocks=64)) as llm:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return [r.text for r in results]


def greedy_streams(client: Any, prompts: list[str], max_tokens: int) -> list[str | None]:
    """Stream every prompt at once (greedy); each one's text, None for one that did not
    end within 120 s."""
    results: list[tuple[str, str] | None] = [None] * len(prompts)
    progress = [0] * len(prompts)

    def run(i: int) -> None:
        results[i] = greedy_stream(client, prompts[i], max_tokens, progress, i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return [r[0] if r else None for r in results]


def streams_through_a_kill(
    client: Any, prompts: list[str], max_tokens: int, kill: Any, under_way: int,
    server: Server | None = None,
) -> list[tuple[str, str] | BaseException | None]:
    """Stream every prompt at once; once each has `under_way` chunks, call `kill()`;
    the streams' results (or what each raised) once all have ended (300 s at most). A
    stream still open then fails the test with each stream's chunk count and the tail of
    `server`'s log (what the fleet was doing)."""
    progress = [0] * len(prompts)
    results: list[tuple[str, str] | BaseException | None] = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            results[i] = greedy_stream(client, prompts[i], max_tokens, progress, i)
        except BaseException as e:  # reported by the caller
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    end = time.monotonic() + 120
    while min(progress) < under_way and time.monotonic() < end:  # every stream under way
        time.sleep(0.01)
    assert min(progress) >= under_way, progress
    kill()
    for t in threads:
        t.join(300)
    if any(t.is_alive() for t in threads):
        tail = "".join(server.log[-120:]) if server is not None else ""
        raise AssertionError(f"a stream hangs; chunks per stream: {progress}\n{tail}")
    return results


def kill_a_busy_worker(server: Server, workers: list[str]) -> None:
    """SIGKILL the worker of `workers` running the most requests (at least one: some
    streams must move), and take it off the list. The router may have put every stream
    on one worker (earlier runs' prefix caches steer them back)."""
    running = {w: server.metrics(w)["diptych_worker_running_requests"] for w in workers}
    victim = max(workers, key=lambda w: running[w])
    assert running[victim] >= 1, running
    workers.remove(victim)
    os.kill(server.manifest[victim]["pid"], signal.SIGKILL)



def idle_metrics(server: Server, child: str = "decode-0", timeout: float = 30) -> dict[str, float]:
    """`child`'s metrics once it runs, queues and holds nothing (its last request's
    blocks can go back a moment after the client read the last token), or the last
    sample after `timeout` seconds: the caller asserts what it expects of it."""
    end = time.monotonic() + timeout
    while True:
        m = server.metrics(child)
        busy = sum(m.get(f"diptych_worker_{name}", 0.0) for name in (
            "kv_used_blocks", "running_requests", "waiting_requests", "remote_waiting_requests"
        ))  # fmt: skip
        if busy == 0 or time.monotonic() > end:
            return m
        time.sleep(0.1)
