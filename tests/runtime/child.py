"""Child processes for the crash tests: a worker to SIGKILL, a consumer that dies holding.

Usage (the tests start these through the ``spawn`` fixture):

    child.py register URL NAMESPACE WORKER_ID TTL     print "READY <incarnation>", keep alive
    child.py hold URL NAMESPACE ACK_WAIT MAX_DELIVERIES  fetch one, print "HOLDING <id>", hang
    child.py claim URL NAMESPACE ACK_WAIT MAX_DELIVERIES fetch one, claim it, print "CLAIMED <id>",
                                                       hang without acking
    child.py serve                                     a decode worker's gRPC server with a fake
                                                       engine, print "SERVING <host:port>"
"""

from __future__ import annotations

import asyncio
import sys

from runtime.config import make_discovery, make_prefill_queue
from runtime.discovery import DiscoveryOptions
from runtime.queue import QueueOptions
from runtime.worker_info import WorkerInfo


async def register(url: str, namespace: str, worker_id: str, ttl: str) -> None:
    discovery = make_discovery(url, DiscoveryOptions(namespace=namespace, ttl=float(ttl)))
    await discovery.connect()
    info = WorkerInfo(worker_id, "decode", "test-model", grpc_address="127.0.0.1:1")
    await discovery.register(info)
    print("READY", info.incarnation_id, flush=True)
    await asyncio.Event().wait()


async def consume(mode: str, url: str, namespace: str, ack_wait: str, max_del: str) -> None:
    options = QueueOptions(
        namespace=namespace, ack_wait=float(ack_wait), max_deliveries=int(max_del), done_ttl=600
    )
    queue = make_prefill_queue(url, options)
    await queue.connect()
    while True:
        deliveries = await queue.fetch(1, timeout=5.0)
        if deliveries:
            break
    delivery = deliveries[0]
    if mode == "claim":
        assert await delivery.claim_completion()
        print("CLAIMED", delivery.request.request_id, flush=True)
    else:
        print("HOLDING", delivery.request.request_id, flush=True)
    await asyncio.Event().wait()


async def serve() -> None:
    from runtime.rpc import DecodeWorkerServer
    from tests.runtime.rt_helpers import ScriptedHandler  # PYTHONPATH is the repository

    server = DecodeWorkerServer(ScriptedHandler(delay=0.005))
    print("SERVING", await server.start(), flush=True)
    await server.wait()


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "register":
        asyncio.run(register(*args))
    elif mode == "serve":
        asyncio.run(serve())
    else:
        asyncio.run(consume(mode, *args))


if __name__ == "__main__":
    main()
