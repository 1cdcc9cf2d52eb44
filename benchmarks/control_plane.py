#!/usr/bin/env python
"""Control-plane benchmark: prefill queue, discovery watches, gRPC token streams.

    python benchmarks/control_plane.py                  # everything, servers started here
    python benchmarks/control_plane.py --quick          # smoke run, well under a minute
    python benchmarks/control_plane.py --nats-url nats://h:4222 --etcd-url etcd://h:2379

Measured, for the production backend and the embedded one side by side:

- prefill queue, latency: one request at a time, publish -> fetch returns it (delivery)
  and publish -> ack confirmed (round trip), p50/p99 over ``--latency-n`` requests;
- prefill queue, throughput: ``--queue-n`` requests published with 32 in flight while
  one consumer fetches batches of 32 and acks each; requests per second from the first
  publish to the last ack;
- discovery: register -> a watcher in another client sees the join, and close -> it sees
  the leave, p50/p99 over ``--watch-n`` workers;
- gRPC: tokens per second of Generate streams over one connection to a decode-worker
  server in a child process whose handler yields tokens without computing anything
  (1 token per chunk), with 1 and 64 concurrent streams.

Queue messages carry a ``--prompt-tokens``-token prompt (1024: a ~3 KB payload). Without
URLs, nats-server (JetStream, file storage) and etcd are started on free loopback ports
with temporary data directories. All clients of one measurement run in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# first, also when the root is on PYTHONPATH: benchmarks/kernels.py would shadow `kernels`
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))

from protocol.sampling import SamplingParams  # noqa: E402
from runtime.config import make_discovery, make_prefill_queue  # noqa: E402
from runtime.discovery import DiscoveryOptions, EventKind  # noqa: E402
from runtime.queue import PrefillQueue, QueueOptions, RemotePrefillRequest  # noqa: E402
from runtime.rpc import (  # noqa: E402
    DecodeWorkerClient,
    DecodeWorkerServer,
    FinishReason,
    GenerateChunk,
    GenerateHandler,
    GenerateRequest,
    HealthReport,
    ServingStatus,
    Usage,
)
from runtime.worker_info import WorkerInfo  # noqa: E402


# -- servers ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(check: object, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if check():  # type: ignore[operator]
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start")


@contextmanager
def servers(nats_url: str | None, etcd_url: str | None) -> Iterator[tuple[str, str]]:
    procs: list[subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="diptych-bench-"))
    try:
        if nats_url is None:
            port = _free_port()
            cmd = [
                "nats-server",
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                str(port),
                "-sd",
                str(tmp / "nats"),
            ]
            procs.append(subprocess.Popen(cmd, stderr=subprocess.DEVNULL))
            _wait(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None, "nats")
            nats_url = f"nats://127.0.0.1:{port}"
        if etcd_url is None:
            port, peer = _free_port(), f"http://127.0.0.1:{_free_port()}"
            client = f"http://127.0.0.1:{port}"
            cmd = ["etcd", "--data-dir", str(tmp / "etcd"), "--listen-client-urls", client,
                   "--advertise-client-urls", client, "--listen-peer-urls", peer,
                   "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}",
                   "--log-level", "error"]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stderr=subprocess.DEVNULL))
            _wait(
                lambda: b"true" in urllib.request.urlopen(f"{client}/health", timeout=1).read(),
                "etcd",
            )
            etcd_url = f"etcd://127.0.0.1:{port}"
        yield nats_url, etcd_url
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


# -- statistics ---------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def ms(values: list[float]) -> str:
    return f"{pct(values, 50) * 1e3:.2f} / {pct(values, 99) * 1e3:.2f}"


# -- prefill queue ------------------------------------------------------------------------
def prefill_request(i: int, tokens: int) -> RemotePrefillRequest:
    return RemotePrefillRequest(
        request_id=f"bench-{uuid.uuid4().hex[:8]}-{i}",
        prompt_token_ids=tuple(range(1, tokens + 1)),
        sampling=SamplingParams(temperature=0.0), decode_worker_id="decode-0",
        decode_incarnation_id="inc", transfer_agent="agent", dst_block_ids=(0,),
        num_cached_tokens=0, deadline=time.time() + 600, kv_layout_hash="h",
    )  # fmt: skip


async def queue_bench(url: str, n_latency: int, n_throughput: int, tokens: int) -> dict[str, str]:
    opts = QueueOptions(namespace="b" + uuid.uuid4().hex[:10], ack_wait=30.0, max_pending=100_000)
    async with make_prefill_queue(url, opts) as pub, make_prefill_queue(url, opts) as con:
        fetched: dict[str, float] = {}
        acked: dict[str, float] = {}
        arrived = asyncio.Event()

        async def consume() -> None:  # an idle prefill worker, waiting in fetch()
            while True:
                for d in await con.fetch(1, timeout=10.0):
                    fetched[d.request.request_id] = time.perf_counter()
                    await d.ack()
                    acked[d.request.request_id] = time.perf_counter()
                    arrived.set()

        consumer = asyncio.create_task(consume())
        deliver, round_trip = [], []
        rng = random.Random(0)
        for i in range(n_latency + 10):
            await asyncio.sleep(rng.uniform(0.001, 0.02))  # arrivals out of phase with polls
            req = prefill_request(i, tokens)
            arrived.clear()
            t0 = time.perf_counter()
            await pub.publish(req)
            await asyncio.wait_for(arrived.wait(), 10.0)
            if i >= 10:  # warm-up
                deliver.append(fetched[req.request_id] - t0)
                round_trip.append(acked[req.request_id] - t0)
        consumer.cancel()
        rate = await _throughput(pub, con, n_throughput, tokens)
    return {"deliver": ms(deliver), "round_trip": ms(round_trip), "rate": f"{rate:,.0f}"}


async def _throughput(pub: PrefillQueue, con: PrefillQueue, n: int, tokens: int) -> float:
    requests = [prefill_request(i, tokens) for i in range(n)]
    window = asyncio.Semaphore(32)

    async def publish_all() -> None:
        async def one(r: RemotePrefillRequest) -> None:
            async with window:
                await pub.publish(r)

        await asyncio.gather(*(one(r) for r in requests))

    async def consume_all() -> None:
        done = 0
        while done < n:
            for d in await con.fetch(32, timeout=10.0):
                await d.ack()
                done += 1

    t0 = time.perf_counter()
    await asyncio.gather(publish_all(), consume_all())
    return n / (time.perf_counter() - t0)


# -- discovery ----------------------------------------------------------------------------
async def watch_bench(url: str, n: int) -> dict[str, str]:
    opts = DiscoveryOptions(namespace="b" + uuid.uuid4().hex[:10], ttl=10.0)
    async with make_discovery(url, opts) as workers, make_discovery(url, opts) as router:
        seen: dict[tuple[EventKind, str], float] = {}
        changed = asyncio.Event()

        async def watch() -> None:
            async for event in router.watch("decode"):
                seen[(event.kind, event.worker.worker_id)] = time.perf_counter()
                changed.set()

        async def wait_for(key: tuple[EventKind, str]) -> float:
            while key not in seen:
                changed.clear()
                await asyncio.wait_for(changed.wait(), 10.0)
            return seen[key]

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.5)
        joins, leaves = [], []
        rng = random.Random(0)
        for i in range(n):
            await asyncio.sleep(rng.uniform(0.001, 0.1))  # out of phase with the polls
            info = WorkerInfo(f"w{i}", "decode", "model", grpc_address="127.0.0.1:1")
            t0 = time.perf_counter()
            reg = await workers.register(info)
            joins.append(await wait_for((EventKind.JOIN, info.worker_id)) - t0)
            t0 = time.perf_counter()
            await reg.close()
            leaves.append(await wait_for((EventKind.LEAVE, info.worker_id)) - t0)
        task.cancel()
    return {"join": ms(joins), "leave": ms(leaves)}


# -- gRPC ---------------------------------------------------------------------------------
class FastHandler(GenerateHandler):
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        n = request.sampling.max_tokens or 1
        for i in range(n):
            yield GenerateChunk(token_ids=(i % 32000,))
        yield GenerateChunk(finish_reason=FinishReason.LENGTH, usage=Usage(1, n))

    async def health(self) -> HealthReport:
        return HealthReport(ServingStatus.SERVING)


def _serve(port: int) -> None:
    async def main() -> None:
        server = DecodeWorkerServer(FastHandler(), f"127.0.0.1:{port}")
        await server.start()
        await server.wait()

    asyncio.run(main())


async def grpc_bench(tokens_per_stream: int, concurrencies: list[int]) -> dict[int, str]:
    port = _free_port()
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    proc.start()
    out = {}
    try:
        async with DecodeWorkerClient(f"127.0.0.1:{port}") as client:
            for c in concurrencies:
                n = max(1, tokens_per_stream // c)

                async def stream(i: int, n: int = n) -> int:
                    req = GenerateRequest(
                        f"s{i}-{uuid.uuid4().hex[:6]}", (1,), SamplingParams(max_tokens=n)
                    )
                    return sum([len(ch.token_ids) async for ch in client.generate(req)])

                await stream(-1, 100)  # warm-up
                t0 = time.perf_counter()
                total = sum(await asyncio.gather(*(stream(i) for i in range(c))))
                out[c] = f"{total / (time.perf_counter() - t0):,.0f}"
    finally:
        proc.terminate()
        proc.join(10)
    return out


# -- report -------------------------------------------------------------------------------
async def run(args: argparse.Namespace, nats_url: str, etcd_url: str) -> str:
    embedded = f"embedded:{tempfile.mkdtemp(prefix='diptych-bench-state-')}"
    rows = []
    for name, url in (("NATS JetStream", nats_url), ("embedded (SQLite)", embedded)):
        r = await queue_bench(url, args.latency_n, args.queue_n, args.prompt_tokens)
        rows.append(f"| {name} | {r['deliver']} | {r['round_trip']} | {r['rate']} |")
    watch_rows = []
    for name, url in (("etcd", etcd_url), ("embedded (SQLite)", embedded)):
        r = await watch_bench(url, args.watch_n)
        watch_rows.append(f"| {name} | {r['join']} | {r['leave']} |")
    grpc = await grpc_bench(args.grpc_tokens, [1, 16, 64, 256])
    shutil.rmtree(embedded.removeprefix("embedded:"), ignore_errors=True)
    lines = [
        f"Prefill queue, {args.prompt_tokens}-token prompts. Latency: {args.latency_n} requests "
        "one at a time at random gaps, to a consumer waiting in fetch(); throughput: "
        f"{args.queue_n} requests, 32 publishes in flight, fetched in batches of 32:",
        "",
        "| backend | publish→fetch p50 / p99 (ms) | publish→ack p50 / p99 (ms) "
        "| publish+fetch+ack per s |",
        "|---|---|---|---|",
        *rows,
        "",
        "Discovery, register→watcher sees join and close→watcher sees leave, "
        f"{args.watch_n} workers:",
        "",
        "| backend | join p50 / p99 (ms) | leave p50 / p99 (ms) |",
        "|---|---|---|",
        *watch_rows,
        "",
        "gRPC Generate through one connection, server in another process, 1 token per chunk:",
        "",
        "| concurrent streams | tokens per s |",
        "|---|---|",
        *(f"| {c} | {v} |" for c, v in grpc.items()),
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nats-url")
    p.add_argument("--etcd-url")
    p.add_argument("--latency-n", type=int, default=500)
    p.add_argument("--queue-n", type=int, default=5000)
    p.add_argument("--watch-n", type=int, default=50)
    p.add_argument("--grpc-tokens", type=int, default=100_000)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    args = p.parse_args()
    if args.quick:
        args.latency_n, args.queue_n, args.watch_n, args.grpc_tokens = 50, 500, 10, 10_000
    with servers(args.nats_url, args.etcd_url) as (nats_url, etcd_url):
        report = asyncio.run(run(args, nats_url, etcd_url))
    print(f"{platform.node()}: {platform.processor() or platform.machine()}, "
          f"{multiprocessing.cpu_count()} cores, Python {platform.python_version()}")  # fmt: skip
    print(report)


if __name__ == "__main__":
    main()
