"""Faults under load on real processes, one after another, in one table.

`diptych serve --nats --etcd` (two prefill and two decode workers; the simulated engine
by default, `--real` for the default model) runs under two loads at once: `diptych
bench` in the background, and checking clients that stream greedy completions of long,
unique prompts (so they prefill remotely) and check each one: a 200, `[DONE]`, no error
event, exactly the tokens asked for (none lost or duplicated by a retry or a
migration). Then each fault in turn, with a quiet spell between:

    none              the baseline
    kill prefill-0    SIGKILL (serve restarts it)
    kill decode-0     SIGKILL mid-stream: its streams migrate
    SIGTERM decode-1  a drain: it leaves discovery, finishes its streams, exits
    restart NATS      down 1 s, JetStream on disk
    restart etcd      down 1 s
    freeze NATS/etcd  SIGSTOP for 2 s, then SIGCONT: unreachable, as in a partition
    overload          the checking clients x8 for a few seconds: 429s, not failures

For each: requests started in the phase, failed, truncated or duplicated, refused (429),
KV blocks still held by any worker once the phase is idle, and the recovery time: from
the fault to the last first token after it that took more than 3x the baseline's p99
(requests in flight at the fault included; for the overload, its duration included).

    python benchmarks/chaos.py                   # about 3 minutes on the simulated engine
    python benchmarks/chaos.py --write-docs      # the table into docs/reliability.md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from tests.e2e.serving import Server  # noqa: E402  (the test suite's process handles)
from tests.servers import EtcdServer, NatsServer  # noqa: E402

SIM = ("--engine", "sim", "--profile", "H200:Llama-3.1-70B:tp8", "--time-scale", "1")
MAX_TOKENS = 24


@dataclass
class Result:
    started: float
    ttft: float | None
    status: int
    tokens: int
    finish: str | None
    error: str
    done: bool

    @property
    def refused(self) -> bool:
        return self.status == 429

    @property
    def failed(self) -> bool:
        return not self.refused and (self.status != 200 or bool(self.error) or not self.done)

    @property
    def damaged(self) -> bool:  # truncated or duplicated
        return (
            not self.failed
            and not self.refused
            and (self.tokens != MAX_TOKENS or self.finish != "length")
        )


class Load:
    """Checking clients: each streams one request after another until stopped."""

    def __init__(self, url: str, model: str, words: int) -> None:
        self.url, self.model, self.words = url, model, words
        self.results: list[Result] = []
        self._lock = threading.Lock()
        self._n = 0
        self._threads: list[tuple[threading.Thread, threading.Event]] = []

    def add(self, clients: int) -> threading.Event:
        stop = threading.Event()
        for _ in range(clients):
            t = threading.Thread(target=self._client, args=(stop,), daemon=True)
            t.start()
            self._threads.append((t, stop))
        return stop

    def stop(self) -> None:
        for _, stop in self._threads:
            stop.set()
        for t, _ in self._threads:
            t.join(300)
        self._threads.clear()

    def _prompt(self) -> str:
        with self._lock:
            self._n += 1
            n = self._n
        return " ".join(f"r{n}w{k}" for k in range(self.words))

    def _client(self, stop: threading.Event) -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                self._one(c)

    def _one(self, c: httpx.Client) -> None:
        body = {
            "model": self.model, "prompt": self._prompt(), "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        start = time.monotonic()
        r = Result(start, None, 0, 0, None, "", False)
        try:
            with c.stream("POST", self.url + "/v1/completions", json=body) as resp:
                r.status = resp.status_code
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        r.done = True
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        r.error = str(event["error"])[:200]
                        continue
                    if r.ttft is None and event.get("choices"):
                        r.ttft = time.monotonic() - start
                    for choice in event.get("choices", []):
                        r.finish = choice.get("finish_reason") or r.finish
                    if event.get("usage"):
                        r.tokens = event["usage"]["completion_tokens"]
        except httpx.HTTPError as e:
            r.error = repr(e)
        with self._lock:
            self.results.append(r)


@dataclass
class Phase:
    name: str
    fault: Callable[[], None] | None


def run(args: argparse.Namespace) -> tuple[list[dict[str, object]], str]:
    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    nats, etcd = NatsServer("nats", tmp / "nats"), EtcdServer("etcd", tmp / "etcd")
    nats.start()
    etcd.start()
    engine = () if args.real else SIM
    server = Server(
        tmp / "state", *engine, "--prefill-workers", "2", "--decode-workers", "2",
        "--nats", f"127.0.0.1:{nats.port}", "--etcd", f"127.0.0.1:{etcd.port}",
        "--max-queued-per-worker", str(args.max_queued), "--min-remote-prefill-tokens", "32",
    )  # fmt: skip
    bench = None
    try:
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        bench = subprocess.Popen(
            [sys.executable, "-m", "diptych.cli", "bench", "--base-url", server.url,
             "--dataset-name", "random", "--random-input-len", "300", "--random-output-len",
             "32", "--num-prompts", "100000", "--request-rate", str(args.bench_rate),
             "--max-concurrency", "4", "--disable-tqdm", "--ignore-eos",
             "--request-timeout", "300"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        load = Load(server.url, model, args.words)

        def kill(child: str) -> Callable[[], None]:
            return lambda: os.kill(server.manifest[child]["pid"], signal.SIGKILL)

        def term(child: str) -> Callable[[], None]:
            return lambda: os.kill(server.manifest[child]["pid"], signal.SIGTERM)

        def freeze(s: NatsServer | EtcdServer) -> Callable[[], None]:
            def go() -> None:
                assert s.proc is not None
                s.proc.send_signal(signal.SIGSTOP)
                time.sleep(2.0)
                s.proc.send_signal(signal.SIGCONT)

            return go

        def overload() -> None:
            extra = load.add(args.clients * 7)
            time.sleep(args.overload_s)
            extra.set()

        phases = [
            Phase("none", None),
            Phase("kill prefill-0 (SIGKILL)", kill("prefill-0")),
            Phase("kill decode-0 (SIGKILL, mid-stream)", kill("decode-0")),
            Phase("SIGTERM decode-1 (drain)", term("decode-1")),
            Phase("restart NATS (down 1 s)", lambda: nats.restart(down_for=1.0)),
            Phase("restart etcd (down 1 s)", lambda: etcd.restart(down_for=1.0)),
            Phase("freeze NATS 2 s (SIGSTOP: unreachable)", freeze(nats)),
            Phase("freeze etcd 2 s (SIGSTOP: unreachable)", freeze(etcd)),
            Phase(f"overload (clients x8 for {args.overload_s:g} s)", overload),
        ]
        rows = []
        baseline_p99 = None
        for phase in phases:
            load.results.clear()
            load.add(args.clients)
            time.sleep(args.warm_s)
            fault_at = time.monotonic()
            if phase.fault is not None:
                phase.fault()
            time.sleep(args.phase_s)
            load.stop()
            results = list(load.results)
            leaked = _held_blocks(server, args.settle_s)
            ttfts = sorted(r.ttft for r in results if r.ttft is not None)
            p99 = ttfts[int(0.99 * (len(ttfts) - 1))] if ttfts else 0.0
            if baseline_p99 is None:
                baseline_p99 = p99
            # slow first tokens that came after the fault (those in flight at it included)
            firsts = [(r.started + r.ttft, r.ttft) for r in results if r.ttft is not None]
            slow = [at for at, t in firsts if at >= fault_at and t > 3 * baseline_p99]
            recovery = max((at - fault_at for at in slow), default=0.0)
            row = {
                "fault": phase.name, "requests": len(results),
                "failed": sum(r.failed for r in results),
                "damaged": sum(r.damaged for r in results),
                "refused": sum(r.refused for r in results), "leaked": leaked,
                "recovery": recovery if phase.fault else None, "p99": p99,
                "errors": sorted({r.error for r in results if r.failed})[:3],
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows, model
    finally:
        if bench is not None:
            bench.terminate()
            bench.wait(30)
        server.stop()
        nats.stop()
        etcd.stop()


def _held_blocks(server: Server, settle_s: float) -> float:
    """KV blocks held by any worker once in-flight work drained (the background bench
    keeps running, so wait for an instant when nothing is in flight)."""
    end = time.monotonic() + settle_s
    held = -1.0
    while time.monotonic() < end:
        held = 0.0
        try:
            for child in ("decode-0", "decode-1", "prefill-0", "prefill-1"):
                m = server.metrics(child)
                busy = sum(m.get(f"diptych_worker_{g}", 0.0) for g in (
                    "running_requests", "waiting_requests", "prefills_in_flight"))  # fmt: skip
                if busy:
                    held = -1.0
                    break
                held += m.get("diptych_worker_kv_used_blocks", 0.0)
        except (httpx.HTTPError, KeyError):
            held = -1.0  # a restarted worker not up yet
        if held >= 0:
            return held
        time.sleep(0.05)
    return held


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--real", action="store_true", help="the default model, not the simulator")
    p.add_argument("--clients", type=int, default=4, help="checking clients in each phase")
    p.add_argument("--words", type=int, default=200, help="prompt length, in words")
    p.add_argument("--bench-rate", type=float, default=4.0, help="diptych bench requests/s")
    p.add_argument("--warm-s", type=float, default=3.0)
    p.add_argument("--phase-s", type=float, default=10.0, help="load after each fault")
    p.add_argument("--settle-s", type=float, default=20.0)
    p.add_argument("--overload-s", type=float, default=4.0)
    p.add_argument("--max-queued", type=int, default=4, help="--max-queued-per-worker")
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    start = machine.snapshot()
    rows, model = run(args)
    end = machine.snapshot()
    lines = [
        "| fault | requests | failed | truncated or duplicated | refused (429) | "
        "blocks held after | recovery |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rec = "-" if r["recovery"] is None else f"{r['recovery']:.1f} s"
        leaked = "busy" if r["leaked"] == -1 else f"{r['leaked']:.0f}"
        lines.append(f"| {r['fault']} | {r['requests']} | {r['failed']} | {r['damaged']} | "
                     f"{r['refused']} | {leaked} | {rec} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if args.write_docs:
        what = "the default model" if args.real else f"the simulated `{model}`"
        body = f"""`python benchmarks/chaos.py{" --real" if args.real else ""} --write-docs`:
`diptych serve --nats --etcd` with two prefill and two decode workers serving {what},
`--max-queued-per-worker {args.max_queued}`; `diptych bench` in the background at
{args.bench_rate:g} requests/s, and {args.clients} checking clients streaming greedy
{MAX_TOKENS}-token completions of unique {args.words}-word prompts one after another. Each
fault is applied {args.warm_s:g} s into its phase and the load runs {args.phase_s:g} s
more. Failed: not a 200, an error event or no `[DONE]`; truncated or duplicated: not
exactly {MAX_TOKENS} tokens with `finish_reason` length; blocks held after: KV blocks
allocated on any worker at the first moment nothing was in flight after the phase;
recovery: from the fault to the last first token after it that took more than 3x the
baseline's p99 (requests in flight at the fault included; the overload's own duration
included).

{table}

{machine.describe(start, end)}"""
        write_subsection("### Faults under load, measured", body, section="## Measured",
                         path=ROOT / "docs" / "reliability.md")  # fmt: skip
        print("wrote docs/reliability.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
