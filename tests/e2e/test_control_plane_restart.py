"""NATS and etcd restarted, or frozen, under load: `diptych serve --nats --etcd` over the simulated
engine (one prefill, one decode worker; every prompt long enough to prefill remotely),
six clients streaming back to back. No request fails, and none waits for more than a
few seconds past the outage (a remote prefill in flight at the restart resumes or falls
back, it does not wait out its deadline)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from tests.e2e.serving import Server
from tests.servers import EtcdServer, NatsServer

pytestmark = pytest.mark.slow

CLIENTS = 6
DOWN_S = 1.0
FROZEN_S = 2.0
BOUND_S = 8.0  # the longest first token allowed: the outage plus reconnects, not a deadline
# load before the first fault, and after each: a request started in an outage finishes
# (or fails) after it whatever the window, the join waits for it; the window after is
# long enough for the clients' next requests to show the plane serving again
WARM_S, AFTER_S = 2.0, 4.0


@pytest.fixture(scope="module")
def plane(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[NatsServer, EtcdServer, Server]]:
    """One fleet for both tests: each leaves NATS and etcd up again (restarted, or
    thawed) and the fleet serving, which the next one's load shows."""
    tmp_path = tmp_path_factory.mktemp("plane")
    nats, etcd = NatsServer("nats", tmp_path / "nats"), EtcdServer("etcd", tmp_path / "etcd")
    nats.start()
    etcd.start()
    server = None
    try:
        server = Server(
            tmp_path / "state",
            "--engine", "sim", "--profile", "H200:Llama-3.1-70B:tp8", "--time-scale", "1",
            "--prefill-workers", "1", "--decode-workers", "1",
            "--nats", f"127.0.0.1:{nats.port}", "--etcd", f"127.0.0.1:{etcd.port}",
        )  # fmt: skip
        yield nats, etcd, server
    finally:
        if server is not None:
            assert server.stop() == 0
        nats.stop()
        etcd.stop()


def _under_load(server: Server, faults: Callable[[], None]) -> None:
    """Six clients stream back to back while ``faults`` runs; then the checks."""
    model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    done = threading.Event()
    results: list[tuple[float, float | None, bool, str]] = []  # start, TTFT, ok, error
    lock = threading.Lock()

    def client(i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as c:
            while not done.is_set():
                n += 1
                words = " ".join(f"c{i}r{n}w{k}" for k in range(250))  # unique: no cache
                start, ttft, ok, error = time.monotonic(), None, False, ""
                try:
                    body = {"model": model, "prompt": words, "max_tokens": 8, "stream": True}
                    with c.stream("POST", server.url + "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if ttft is None and line.startswith("data: "):
                                ttft = time.monotonic() - start
                            if '"error"' in line:
                                error = line
                            ok = ok or (line == "data: [DONE]" and r.status_code == 200)
                except httpx.HTTPError as e:
                    error = repr(e)
                with lock:
                    results.append((start, ttft, ok and not error, error))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        faults()
    finally:
        done.set()
        for t in threads:
            t.join(150)
    failed = [r for r in results if not r[2]]
    assert not failed, failed[:3]
    assert len(results) > 50
    slowest = max(r[1] or 0.0 for r in results)
    assert slowest < BOUND_S, f"a first token took {slowest:.1f}s"
    decode = server.metrics("decode-0")
    assert decode['diptych_worker_remote_prefills_finished_total{result="ok"}'] > 0
    timeouts = decode.get('diptych_worker_remote_prefills_finished_total{result="timeout"}', 0)
    assert timeouts == 0


def test_nats_then_etcd_restarted_under_load(
    plane: tuple[NatsServer, EtcdServer, Server],
) -> None:
    nats, etcd, server = plane

    def faults() -> None:
        time.sleep(WARM_S)
        nats.restart(down_for=DOWN_S)
        time.sleep(AFTER_S)
        etcd.restart(down_for=DOWN_S)
        time.sleep(AFTER_S)

    _under_load(server, faults)


def test_nats_then_etcd_unreachable_for_a_while_under_load(
    plane: tuple[NatsServer, EtcdServer, Server],
) -> None:
    """A frozen server (SIGSTOP, then SIGCONT) is what a partition looks like to its
    clients: connections stay open and nothing answers."""
    nats, etcd, server = plane

    def freeze(s: NatsServer | EtcdServer) -> None:
        assert s.proc is not None
        s.proc.send_signal(signal.SIGSTOP)
        time.sleep(FROZEN_S)
        s.proc.send_signal(signal.SIGCONT)

    def faults() -> None:
        time.sleep(WARM_S)
        freeze(nats)
        time.sleep(AFTER_S)
        freeze(etcd)
        time.sleep(AFTER_S)

    _under_load(server, faults)
