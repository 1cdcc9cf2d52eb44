"""The control plane attacked from the network: `diptych serve` with a deployment secret on
real nats-server and etcd that require a password and TLS with client certificates (made
by the test), the real model, KV over tcp (a receiver that refuses before a byte lands).

* Without the brokers' credentials nobody connects: no subscriber reads a prompt, no
  publisher reaches the queue, discovery cannot be read.
* A holder of the NATS credentials (but not the deployment secret) publishes
  remote-prefill messages naming the decode worker's blocks: unsigned, signed with
  another key, and a genuine message recorded by a subscriber and published again. The
  prefill worker works on none of them (no prefill, no byte written) and counts each by
  reason.
* A peer that holds the secret (it registers as a prefill worker, so the decode worker
  trusts its transfer agent) writes without a grant, announces a prefill it never made,
  and uses a request's grant outside the request's blocks. Each is refused and counted;
  the request falls back to local prefill and its greedy text is the text the same
  prompt gets without the attack (greedy fp32 text is the same on every path).
* Discovery written to list a decode worker whose address is another server of the
  deployment (the prefill worker's gRPC port): the frontend refuses its answers (they
  do not prove they come from that worker), counts them, and serves every request.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import nats
import pytest
from nats.errors import NoServersError

from benchmarks.servers import scrape
from protocol.sampling import SamplingParams
from runtime.config import make_discovery, parse_url
from runtime.discovery import DiscoveryOptions
from runtime.errors import ControlPlaneError
from runtime.queue import RemotePrefillRequest
from runtime.queue.messages import PrefillNotice
from runtime.queue.signing import Kind, open_sealed, seal
from runtime.secret import derived_key
from runtime.worker_info import TransferInfo, WorkerInfo
from tests.e2e.serving import Server
from tests.secure_servers import PASSWORD, USER, SecureEtcd, SecureNats, make_pki
from transfer import Agent, DescList
from transfer.context import AgentMetadata

SECRET = "attack-test-deployment-secret"
SUBJECT = "diptych.default.prefill.requests"
PROMPT = (
    "Rivers carry water from mountains to the sea, shape valleys, feed farms and cities, "
    "and have guided trade routes for thousands of years. Rivers also"
)
ATTACKED = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\n\n# Now a function that returns the first n prime numbers:\ndef"
)


def _forget_secrets() -> None:
    """This process reads the secret once per use; the test sets it for its module only."""
    import protocol.secret
    from runtime.rpc import auth

    for cached in (protocol.secret.deployment_secret, auth.call_key, auth.answer_key):
        cached.cache_clear()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str, str]]:
    tmp = tmp_path_factory.mktemp("attacks")
    pki = make_pki(tmp)
    nats_s, etcd_s = SecureNats("nats", tmp / "nats", pki), SecureEtcd("etcd", tmp / "etcd", pki)
    nats_s.start()
    etcd_s.start()
    old = os.environ.get("DIPTYCH_CLUSTER_SECRET")
    os.environ["DIPTYCH_CLUSTER_SECRET"] = SECRET
    _forget_secrets()
    server = None
    try:
        server = Server(
            tmp / "state",
            "--dtype", "float32", "--kv-cache-memory", "0.25",
            "--min-remote-prefill-tokens", "16", "--transfer", "tcp",
            "--nats", nats_s.url, "--etcd", etcd_s.url,
        )  # fmt: skip
        yield server, nats_s.url, etcd_s.url
    finally:
        if old is None:
            os.environ.pop("DIPTYCH_CLUSTER_SECRET", None)
        else:
            os.environ["DIPTYCH_CLUSTER_SECRET"] = old
        _forget_secrets()
        if server is not None:
            assert server.stop() == 0, "".join(server.log[-30:])
        nats_s.stop()
        etcd_s.stop()


def _complete(server: Server, prompt: str = PROMPT) -> str:
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
              "ignore_eos": True},
        timeout=120,
    )  # fmt: skip
    r.raise_for_status()
    return str(r.json()["choices"][0]["text"])


def _until(pred: Any, timeout: float = 20.0, show: Any = None) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"condition not reached: {show() if show else ''}"
        time.sleep(0.1)


def _sample(server: Server, child: str, name: str) -> float:
    return server.metrics(child).get(name, 0.0)


async def _records(etcd: str) -> tuple[WorkerInfo, WorkerInfo]:
    async with make_discovery(etcd, DiscoveryOptions(namespace="default")) as d:
        decode, prefill = await d.get("decode", "decode-0"), await d.get("prefill", "prefill-0")
    assert decode is not None and prefill is not None
    return decode, prefill


def _port(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    assert port is not None
    return port


async def _connect(nats_url: str) -> Any:
    """A NATS client holding the brokers' credentials (password and client certificate)."""
    tls = parse_url(nats_url).auth.ssl_context()
    return await nats.connect(
        f"tls://127.0.0.1:{_port(nats_url)}", user=USER, password=PASSWORD, tls=tls
    )


async def test_without_the_brokers_credentials_nobody_connects(
    fleet: tuple[Server, str, str],
) -> None:
    server, nats_url, etcd = fleet
    port = _port(nats_url)
    tls = parse_url(nats_url).auth.ssl_context()
    once = {"connect_timeout": 2, "allow_reconnect": False, "max_reconnect_attempts": 0}
    for url, kw in (
        (f"nats://127.0.0.1:{port}", {}),  # a plain subscriber
        (f"tls://127.0.0.1:{port}", {"tls": tls}),  # the client certificate, no password
        (f"tls://127.0.0.1:{port}", {"tls": tls, "user": USER, "password": "guess"}),
    ):
        with pytest.raises((NoServersError, OSError, nats.errors.Error)):
            nc = await nats.connect(url, **once, **kw)  # type: ignore[arg-type]
            await nc.close()
    plain = f"etcd://127.0.0.1:{_port(etcd)}"
    with pytest.raises(ControlPlaneError):
        async with make_discovery(plain, DiscoveryOptions(op_timeout=3.0)) as d:
            await d.list("decode")
    # the fleet itself is served (a prompt too short for a remote prefill, so the next
    # test's first remote prefill is PROMPT's)
    assert _complete(server, "The capital of France is")


def _forged(decode: WorkerInfo, rid: str) -> bytes:
    assert decode.kv_layout is not None and decode.transfer is not None
    return RemotePrefillRequest(
        request_id=rid, prompt_token_ids=tuple(range(100, 164)),
        sampling=SamplingParams(temperature=0.0), decode_worker_id="decode-0",
        decode_incarnation_id=decode.incarnation_id, transfer_agent=decode.transfer.agent_name,
        dst_block_ids=(1, 2, 3, 4), num_cached_tokens=0, deadline=time.time() + 30,
        kv_layout_hash=decode.kv_layout.layout_hash,
    ).encode()  # fmt: skip


async def test_forged_and_replayed_queue_messages_are_not_worked_on(
    fleet: tuple[Server, str, str],
) -> None:
    server, nats_url, etcd = fleet
    decode, _ = await _records(etcd)
    prefills = 'diptych_worker_prefills_total{result="ok"}'
    sent = "diptych_transfer_sent_bytes_total"
    nc = await _connect(nats_url)
    captured: list[tuple[str, bytes]] = []

    async def record(msg: Any) -> None:
        captured.append((msg.subject, msg.data))

    await nc.subscribe("diptych.default.prefill.>", cb=record)  # a plain subscriber
    await nc.flush()
    try:
        # a genuine remote prefill, recorded on the way
        await asyncio.get_running_loop().run_in_executor(None, _complete, server)
        _until(lambda: _sample(server, "prefill-0", prefills) >= 1)
        await nc.flush()
        genuine = [(s, d) for s, d in captured if d[:4] == b"DQS1"]
        assert genuine, "the subscriber saw no queue message"
        ok_before = _sample(server, "prefill-0", prefills)
        bytes_before = _sample(server, "prefill-0", sent)
        js = nc.jetstream()
        await js.publish(SUBJECT, _forged(decode, "forged-unsigned"))
        other = b"not-the-deployment-key-but-long-enough"
        await js.publish(SUBJECT, seal(other, Kind.REQUEST, _forged(decode, "forged-key")))
        subject, data = genuine[0]
        await js.publish(subject, data)  # the recorded message, published again

        def rejected(reason: str) -> float:
            name = f'diptych_worker_queue_rejected_total{{reason="{reason}"}}'
            return _sample(server, "prefill-0", name)

        def counts() -> dict[str, float]:
            return {r: rejected(r) for r in ("unsigned", "bad_signature", "replayed")}

        want = {"unsigned": 1.0, "bad_signature": 1.0, "replayed": 1.0}
        _until(lambda: counts() == want, show=lambda: (counts(), server.log[-20:]))
        time.sleep(1.0)
        assert _sample(server, "prefill-0", prefills) == ok_before
        assert _sample(server, "prefill-0", sent) == bytes_before
    finally:
        await nc.close()


async def test_a_peer_with_the_secret_writes_only_its_own_reservation(
    fleet: tuple[Server, str, str],
) -> None:
    server, nats_url, etcd = fleet
    decode, prefill = await _records(etcd)
    assert decode.transfer is not None and decode.kv_layout is not None
    region = decode.transfer.kv_region
    md = AgentMetadata.from_bytes(decode.transfer.metadata)
    block_bytes = next(r.nbytes for r in md.regions if r.id == region) // (
        decode.kv_layout.num_blocks
    )
    rogue = Agent("rogue-agent", backend=("tcp",), layout=decode.kv_layout.layout_hash)
    pool = rogue.allocate(4 * block_bytes)
    rogue.add_remote(decode.transfer.metadata)
    discovery = make_discovery(etcd, DiscoveryOptions(namespace="default"))
    await discovery.connect()
    record = WorkerInfo(
        "prefill-rogue", "prefill", prefill.model,
        transfer=TransferInfo("tcp", rogue.name, rogue.metadata(), (pool.id,)),
        kv_layout=prefill.kv_layout, max_model_len=prefill.max_model_len,
    )  # fmt: skip
    registration = await discovery.register(record)
    nc = await _connect(nats_url)
    messages: asyncio.Queue[RemotePrefillRequest] = asyncio.Queue()
    key = derived_key("diptych prefill queue")
    assert key is not None

    async def watch(msg: Any) -> None:
        if msg.data[:4] == b"DQS1":
            body = open_sealed(key, Kind.REQUEST, msg.data).body
            await messages.put(RemotePrefillRequest.decode(body))

    pid = server.manifest["prefill-0"]["pid"]
    try:
        # once the decode worker trusts the rogue, a write without a grant is refused for
        # the grant, not for an unknown peer
        one = DescList.blocks(pool, [0], block_bytes)

        for _ in range(100):
            try:
                await rogue.write(one, md.name, DescList.blocks(region, [5], block_bytes)).wait(10)
                why = "landed"
            except Exception as e:
                why = str(e)
            if "unknown-peer" not in why:
                break
            await asyncio.sleep(0.2)
        assert "no-grant" in why, why

        await nc.subscribe("diptych.default.prefill.>", cb=watch)
        await nc.flush()
        os.kill(pid, signal.SIGSTOP)  # the real prefill worker stays out of the race
        loop = asyncio.get_running_loop()
        attacked = loop.run_in_executor(None, _complete, server, ATTACKED)
        req = await asyncio.wait_for(messages.get(), 60)
        # a notice of a prefill it never made, not under the request's grant
        fake = PrefillNotice(req.request_id, ok=True, first_token=1)
        await rogue.notify(md.name, fake.encode()).wait(10)
        # the request's own grant, used on a block outside its reservation
        blocks = range(1, decode.kv_layout.num_blocks)
        outside = next(b for b in blocks if b not in req.dst_block_ids)
        with pytest.raises(Exception, match="outside-grant"):
            await rogue.write(
                one, md.name, DescList.blocks(region, [outside], block_bytes), grant=req.kv_grant
            ).wait(10)
        text = await asyncio.wait_for(attacked, 120)
    finally:
        os.kill(pid, signal.SIGCONT)
        await nc.close()
        await registration.close()
        await discovery.close()
        rogue.close()
    # the same prompt again (from the prefix cache the fallback filled): the same text
    assert text == _complete(server, ATTACKED)
    m = server.metrics("decode-0")
    assert m['diptych_worker_remote_prefills_finished_total{result="violation"}'] == 1
    assert m["diptych_worker_rejected_prefill_notices_total"] == 1
    assert m['diptych_transfer_failures_total{reason="rejected_grant"}'] >= 2


async def test_a_worker_address_pointing_at_another_server_is_refused(
    fleet: tuple[Server, str, str],
) -> None:
    server, _, etcd = fleet
    decode, prefill = await _records(etcd)
    assert prefill.grpc_address
    name = "diptych_frontend_worker_proof_failures_total"

    def refused() -> float:
        return scrape(server.url).get(name, 0.0)

    before = refused()
    discovery = make_discovery(etcd, DiscoveryOptions(namespace="default"))
    await discovery.connect()
    impostor = WorkerInfo(
        "decode-rogue", "decode", decode.model, grpc_address=prefill.grpc_address,
        kv_layout=decode.kv_layout, max_model_len=decode.max_model_len,
    )  # fmt: skip
    registration = await discovery.register(impostor)
    loop = asyncio.get_running_loop()
    try:
        end = time.monotonic() + 30
        while refused() <= before:  # the frontend follows its events: refused at once
            assert time.monotonic() < end, "the frontend took the impostor's events"
            await asyncio.sleep(0.2)
        for i in range(4):  # whichever worker the router picks, every request is served
            text = await loop.run_in_executor(None, _complete, server, f"{PROMPT} {i}")
            assert text
    finally:
        await registration.close()
        await discovery.close()
