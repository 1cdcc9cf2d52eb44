"""The gRPC request plane: Generate streaming, errors, cancellation, abort, caps, health."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest

from protocol.sampling import SamplingParams
from runtime.errors import InvalidInput
from runtime.proto import diptych_runtime_pb2 as pb
from runtime.rpc import (
    DecodeWorkerClient,
    DecodeWorkerServer,
    ErrorCode,
    FinishReason,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    ServerLimits,
    ServingStatus,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from runtime.rpc.server import SERVICE
from tests.runtime.rt_helpers import ScriptedHandler, eventually, serve


def req(rid: str = "r1", n: int = 4, salt: str = "", **sampling: object) -> GenerateRequest:
    params = SamplingParams(max_tokens=n, **sampling)  # type: ignore[arg-type]
    return GenerateRequest(rid, (1, 2, 3, 4, 5, 6), params, priority=-1, cache_salt=salt)


async def collect(client: DecodeWorkerClient, request: GenerateRequest) -> list[GenerateChunk]:
    return [chunk async for chunk in client.generate(request)]


async def test_generate_streams_tokens_logprobs_and_usage() -> None:
    async with serve(ScriptedHandler()) as (server, client):
        chunks = await collect(client, req(n=3, logprobs=2))
        assert [c.token_ids for c in chunks] == [(100,), (101,), (102,), ()]
        assert chunks[0].logprobs == (
            TokenLogprob(100, -0.5, 1, (TopLogprob(100, -0.5), TopLogprob(101, -1.5))),
        )
        assert chunks[-1].finish_reason is FinishReason.LENGTH and chunks[-1].finished
        assert chunks[-1].usage == Usage(prompt_tokens=6, completion_tokens=3, cached_tokens=4)
        assert not any(c.finished for c in chunks[:-1])
        await eventually(lambda: server.requests_in_flight == 0, what="the entries to go")


async def test_several_tokens_per_chunk() -> None:
    async with serve(ScriptedHandler(per_chunk=4)) as (_, client):
        chunks = await collect(client, req(n=10))
        assert [len(c.token_ids) for c in chunks] == [4, 4, 2, 0]


async def test_handler_errors_end_one_stream_never_the_server() -> None:
    handler = ScriptedHandler()
    async with serve(handler) as (server, client):
        got: list[GenerateChunk] = []
        with pytest.raises(GenerateError) as err:
            async for chunk in client.generate(req("a", n=5, salt="raise-overloaded")):
                got.append(chunk)
        assert len(got) == 2  # the tokens before the failure still arrived
        assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED and err.value.retryable
        assert "KV cache full" in str(err.value)
        for salt, text in [
            ("raise-bug", "index out of range"),
            ("no-finish", "without a finish reason"),
            ("bad-chunk", "handler yielded str"),
        ]:
            with pytest.raises(GenerateError, match=text) as err:
                await collect(client, req(salt, n=5, salt=salt))
            assert err.value.code is ErrorCode.INTERNAL and not err.value.retryable
        assert len(await collect(client, req("after"))) == 5
        await eventually(lambda: server.requests_in_flight == 0, what="the entries to go")
        # Every failed request was aborted on the engine, so its resources are freed.
        assert handler.aborted == ["a", "raise-bug", "no-finish", "bad-chunk"]


class BrokenHandler(ScriptedHandler):
    def generate(self, request: GenerateRequest):  # type: ignore[no-untyped-def, override]
        raise RuntimeError("not even a generator")


async def test_a_handler_that_cannot_start_a_stream() -> None:
    async with serve(BrokenHandler()) as (server, client):
        with pytest.raises(GenerateError, match="not even a generator") as err:
            await collect(client, req("x"))
        assert err.value.code is ErrorCode.INTERNAL
        # (a stream's entry goes when its generator resumes after the last message,
        # which the client may have read first: on a loaded machine, a moment later)
        await eventually(lambda: server.requests_in_flight == 0, what="the entries to go")


@pytest.mark.parametrize("how", ["cancel", "context", "task", "deadline"])
async def test_cancelling_the_stream_aborts_the_request_on_the_worker(how: str) -> None:
    handler = ScriptedHandler(delay=0.01)
    async with serve(handler) as (server, client):
        request = req("long", n=100_000)
        if how == "cancel":
            stream = client.generate(request)
            await anext(stream)
            stream.cancel()
        elif how == "context":
            async with client.generate(request) as stream:
                await anext(stream)
        elif how == "task":
            task = asyncio.create_task(collect(client, request))
            await eventually(lambda: "long" in handler.running, what="the request to start")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(GenerateError) as err:
                async for _ in client.generate(request, timeout=0.3):
                    pass
            assert err.value.code is ErrorCode.DEADLINE_EXCEEDED
        await eventually(lambda: handler.aborted == ["long"], what="handler.abort")
        assert handler.closed == ["long"]  # the engine's generator was closed too
        await eventually(lambda: server.requests_in_flight == 0, what="the entries to go")


async def test_abort_by_request_id() -> None:
    handler = ScriptedHandler(delay=0.01)
    async with serve(handler) as (server, client):
        chunks = []
        async for chunk in client.generate(req("victim", n=100_000)):
            chunks.append(chunk)
            if len(chunks) == 3:
                await client.abort("victim")
        assert chunks[-1].finish_reason is FinishReason.ABORT
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 3
        assert handler.aborted == ["victim"]
        with pytest.raises(GenerateError, match="no request 'ghost'") as err:
            await client.abort("ghost")
        assert err.value.code is ErrorCode.NOT_FOUND
    # An engine that ignores abort() is cut off after abort_grace_s, the stream still ends
    # cleanly with ABORT.
    limits = ServerLimits(abort_grace_s=0.2)
    async with serve(ScriptedHandler(), limits) as (server, client):
        stream = client.generate(req("deaf", salt="hang"))
        reading = asyncio.create_task(anext(stream))
        await eventually(lambda: server.requests_in_flight == 1)
        t0 = time.monotonic()
        await client.abort("deaf")
        final = await reading
        assert final.finish_reason is FinishReason.ABORT
        assert 0.15 < time.monotonic() - t0 < 2.0
        # The final chunk reaches the client before the server's stream unwinds.
        await eventually(lambda: server.requests_in_flight == 0, what="the entry to go")


async def test_duplicate_request_id_in_flight_is_refused() -> None:
    async with serve(ScriptedHandler()) as (_, client):
        first = client.generate(req("dup", salt="hang"))
        reading = asyncio.create_task(anext(first))
        await asyncio.sleep(0.1)
        with pytest.raises(GenerateError, match="already running") as err:
            await collect(client, req("dup"))
        assert err.value.code is ErrorCode.ALREADY_EXISTS
        first.cancel()
        with pytest.raises(GenerateError):
            await reading


async def test_bad_input_on_every_rpc_gives_clear_errors() -> None:
    limits = ServerLimits(
        max_message_bytes=64 * 1024, max_prompt_tokens=1000, snapshot_part_hashes=1000
    )
    async with serve(ScriptedHandler(), limits) as (server, client):
        channel = grpc.aio.insecure_channel(server.address)
        generate = channel.unary_stream(f"/{SERVICE}/Generate")
        abort = channel.unary_unary(f"/{SERVICE}/Abort")

        async def generate_status(payload: bytes) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in generate(payload):
                    pass
            return err.value.code(), err.value.details() or ""

        code, text = await generate_status(b"\xff\xff\xff garbage")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed GenerateRequest" in text
        bad_sampling = pb.GenerateRequest(
            request_id="r", prompt_token_ids=[1], sampling=b'{"temperature": -1.0}'
        )
        code, text = await generate_status(bad_sampling.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in text
        code, text = await generate_status(pb.GenerateRequest(request_id="r").SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in text
        code, text = await generate_status(
            pb.GenerateRequest(prompt_token_ids=[1]).SerializeToString()
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in text
        long_prompt = pb.GenerateRequest(request_id="r", prompt_token_ids=range(1001))
        code, text = await generate_status(long_prompt.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_tokens" in text
        huge = pb.GenerateRequest(request_id="r", prompt_token_ids=[2**20] * 40_000)
        code, text = await generate_status(huge.SerializeToString())
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in text
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await abort(b"\xff\xff\xff")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await channel.close()

        with pytest.raises(InvalidInput, match="request_id"):  # caught before sending
            GenerateRequest("has space", (1,))
        with pytest.raises(InvalidInput, match="logprobs"):
            SamplingParams(logprobs=21)

        health = await client.health()  # and the server is fine
        assert health.status is ServingStatus.SERVING and health.requests_in_flight == 0
        assert len(await collect(client, req("ok"))) == 5


async def test_health() -> None:
    handler = ScriptedHandler(incarnation="inc-7")
    async with serve(handler) as (_, client):
        health = await client.health()
        assert (health.status, health.worker_id, health.incarnation_id) == (
            ServingStatus.SERVING, "w0", "inc-7",
        )  # fmt: skip
        assert health.load.kv_total_blocks == 64
        handler.health_error = RuntimeError("engine wedged")
        health = await client.health()
        assert health.status is ServingStatus.NOT_SERVING and "engine wedged" in health.message


async def test_killed_worker_ends_streams_with_retryable_error(spawn) -> None:  # type: ignore[no-untyped-def]
    worker = spawn("serve")
    address = await worker.expect("SERVING")
    async with DecodeWorkerClient(address) as client:
        stream = client.generate(req("migrate-me", n=1_000_000))
        received = [await anext(stream) for _ in range(5)]
        worker.kill()
        t0 = time.monotonic()
        with pytest.raises(GenerateError) as err:
            async for chunk in stream:
                received.append(chunk)
        assert err.value.code is ErrorCode.UNAVAILABLE and err.value.retryable
        assert time.monotonic() - t0 < 2.0
        assert [c.token_ids[0] for c in received[:5]] == [100, 101, 102, 103, 104]
        with pytest.raises(GenerateError) as err:
            await client.health(timeout=1.0)
        assert err.value.code in (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED)


async def test_two_workers_never_share_a_port() -> None:
    async with serve(ScriptedHandler()) as (server, _):
        second = DecodeWorkerServer(ScriptedHandler(), server.address)
        with pytest.raises(OSError, match="port in use"):
            await second.start()


async def test_with_a_cluster_secret_only_its_holders_are_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server (started with a secret) refuses calls that carry no token or another
    deployment's: Generate, Health and Events alike; the right token is served."""
    from runtime.rpc import auth

    monkeypatch.setattr(auth, "call_key", lambda: b"k" * 32)
    async with serve(ScriptedHandler()) as (_, client):
        assert [c.token_ids for c in await collect(client, req(n=1))] == [(100,), ()]
        assert (await client.health()).status is ServingStatus.SERVING
        for other in (None, b"t" * 32):
            monkeypatch.setattr(auth, "call_key", lambda o=other: o)
            await client.close()  # a client reads the key when it connects
            await client.connect()
            with pytest.raises(GenerateError, match="cluster secret"):
                await collect(client, req(rid=f"x-{other}", n=1))
            with pytest.raises(GenerateError, match="cluster secret"):
                await client.health()
            with pytest.raises(GenerateError, match="cluster secret"):
                async for _ in client.events():
                    break


async def test_a_call_token_serves_one_call_of_its_method_within_its_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A token recorded on the wire is refused: replayed, on another method, too old or
    from the future; a fresh one per call is served."""
    import time

    from runtime.rpc import auth

    key = b"k" * 32
    check = auth.TokenCheck(key)
    now = time.time()
    health = "/diptych.runtime.v1.DecodeWorker/Health"
    token = auth.call_token(key, health, now)
    assert check.accepts(health, token, now)
    assert not check.accepts(health, token, now + 1)  # replayed
    assert not check.accepts(health + "x", auth.call_token(key, health, now), now)
    assert not check.accepts(health, auth.call_token(key, health, now - 90), now)
    assert not check.accepts(health, auth.call_token(key, health, now + 90), now)
    assert not check.accepts(health, auth.call_token(b"o" * 32, health, now), now)
    assert not check.accepts(health, "v2.1.2.3", now) and not check.accepts(health, "", now)

    monkeypatch.setattr(auth, "call_key", lambda: key)
    recorded: list[tuple[tuple[str, str], ...]] = []
    real = auth.call_metadata

    def recording(k: bytes, method: str) -> tuple[tuple[str, str], ...]:
        recorded.append(real(k, method))
        return recorded[-1]

    async with serve(ScriptedHandler()) as (_, client):
        from runtime.rpc import client as client_module

        monkeypatch.setattr(client_module, "call_metadata", recording)
        for _ in range(3):  # each call its own token
            assert (await client.health()).status is ServingStatus.SERVING
        replay = recorded[0]
        monkeypatch.setattr(client_module, "call_metadata", lambda k, method: replay)
        with pytest.raises(GenerateError, match="replayed"):
            await client.health()


# -- which worker answers: the answer proof ------------------------------------------------
KEY, ANSWER_KEY = b"k" * 32, b"a" * 32
HEALTH = f"/{SERVICE}/Health"


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment secret: its request-plane key and its answer key."""
    from runtime.rpc import auth

    monkeypatch.setattr(auth, "call_key", lambda: KEY)
    monkeypatch.setattr(auth, "answer_key", lambda: ANSWER_KEY)


class _Sending(grpc.aio.ServerInterceptor):  # type: ignore[misc,unused-ignore]
    """An impostor's interceptor: takes any call (no token check) and answers with
    ``metadata`` (a made-up or recorded proof) first, or nothing."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self.metadata = metadata

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        from runtime.rpc import auth

        handler = await continuation(details)
        return handler if self.metadata is None else auth._proving(handler, self.metadata)


async def _start(
    monkeypatch: pytest.MonkeyPatch,
    handler: ScriptedHandler,
    worker_id: str | None,
    impostor: bool = False,
    proof: tuple[tuple[str, str], ...] | None = None,
) -> DecodeWorkerServer:
    """A worker server proving ``worker_id``; with ``impostor``, a server that holds no
    secret, accepts every call and answers with ``proof`` first (or nothing)."""
    from runtime.rpc import server as server_module

    server = DecodeWorkerServer(handler, worker_id=worker_id)
    with monkeypatch.context() as m:
        if impostor:
            m.setattr(server_module, "server_interceptors", lambda wid: [_Sending(proof)])
        await server.start()
    return server


async def _client_of(address: str, worker_id: str | None) -> tuple[DecodeWorkerClient, list[int]]:
    refused: list[int] = []
    client = DecodeWorkerClient(
        address, worker_id=worker_id, on_proof_failure=lambda: refused.append(1)
    )
    await client.connect()
    return client, refused


async def _all_four_calls(client: DecodeWorkerClient, handler: ScriptedHandler, rid: str) -> None:
    """Generate, Health, Events and Abort on ``client``, each served."""
    assert [c.token_ids for c in await collect(client, req(rid, n=2))] == [(100,), (101,), ()]
    assert (await client.health()).status is ServingStatus.SERVING
    async for event in client.events():
        assert event.incarnation_id == handler.publisher.incarnation_id
        break
    stream = client.generate(req(f"{rid}-hang", salt="hang"))
    reading = asyncio.create_task(anext(stream))
    await eventually(lambda: f"{rid}-hang" in handler.running)
    await client.abort(f"{rid}-hang")
    assert (await reading).finish_reason is FinishReason.ABORT


async def _refused_on_all_four(
    client: DecodeWorkerClient, handler: ScriptedHandler, refused: list[int], rid: str
) -> None:
    """Each call to ``client`` fails as a retryable UNAVAILABLE, nothing streamed."""
    got: list[GenerateChunk] = []
    with pytest.raises(GenerateError, match="did not prove") as err:
        async for chunk in client.generate(req(rid, n=3)):
            got.append(chunk)
    assert got == [] and err.value.code is ErrorCode.UNAVAILABLE and err.value.retryable
    with pytest.raises(GenerateError, match="did not prove"):
        await client.health()
    with pytest.raises(GenerateError, match="did not prove"):
        async for _ in client.events():
            raise AssertionError("an event from a server that is not the worker")
    stream = client.generate(req(f"{rid}-hang", salt="hang"))
    reading = asyncio.create_task(anext(stream))
    await eventually(lambda: f"{rid}-hang" in handler.running)
    with pytest.raises(GenerateError, match="did not prove"):
        await client.abort(f"{rid}-hang")
    stream.cancel()
    with pytest.raises((GenerateError, asyncio.CancelledError)):
        await reading
    assert len(refused) == 4


async def test_with_a_secret_a_client_takes_answers_only_from_the_worker_it_calls(
    secret: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker named (its discovery id) is served on every call; at its address,
    another worker of the same deployment (worker B where the client expects A) is
    refused: each call fails as UNAVAILABLE (the frontend tries another worker), nothing
    streams, each refusal is counted."""
    handler = ScriptedHandler()
    server = await _start(monkeypatch, handler, "decode-a")
    client, refused = await _client_of(server.address, "decode-a")
    try:
        await _all_four_calls(client, handler, "a")
        assert refused == []
    finally:
        await client.close()
        await server.stop(grace=0)
    handler_b = ScriptedHandler()
    server_b = await _start(monkeypatch, handler_b, "decode-b")
    client, refused = await _client_of(server_b.address, "decode-a")  # it thinks: A
    try:
        await _refused_on_all_four(client, handler_b, refused, "b")
    finally:
        await client.close()
        await server_b.stop(grace=0)


@pytest.mark.parametrize("proof", ["none", "made-up"])
async def test_a_server_without_the_secret_cannot_pass_for_a_worker(
    secret: None, monkeypatch: pytest.MonkeyPatch, proof: str
) -> None:
    """An impostor at a worker's address that takes any token and answers with no proof
    or one it made up (for the right worker, under a key not derived from the secret)."""
    from runtime.rpc import auth

    made_up = None
    if proof == "made-up":
        made_up = ((auth.PROOF_KEY, auth.answer_proof(b"x" * 32, HEALTH, "decode-a", "0" * 32)),)
    handler = ScriptedHandler()
    server = await _start(monkeypatch, handler, "decode-a", True, made_up)
    client, refused = await _client_of(server.address, "decode-a")
    try:
        await _refused_on_all_four(client, handler, refused, proof)
    finally:
        await client.close()
        await server.stop(grace=0)


async def test_a_proof_recorded_from_an_earlier_call_is_refused(
    secret: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proof is bound to its call (the caller's fresh nonce): an impostor replaying
    the worker's proof recorded from the wire is refused."""
    from runtime.rpc import auth

    handler = ScriptedHandler()
    real = await _start(monkeypatch, handler, "decode-a")
    channel = grpc.aio.insecure_channel(real.address)
    try:
        call = channel.unary_unary(HEALTH)(
            pb.HealthRequest().SerializeToString(), metadata=auth.call_metadata(KEY, HEALTH)
        )
        await call
        recorded = tuple((k, v) for k, v in await call.initial_metadata() if k == auth.PROOF_KEY)
        assert len(recorded) == 1  # the worker proved this one call
    finally:
        await channel.close()
        await real.stop(grace=0)
    impostor = await _start(monkeypatch, ScriptedHandler(), "decode-a", True, recorded)
    client, refused = await _client_of(impostor.address, "decode-a")
    try:
        with pytest.raises(GenerateError, match="did not prove"):
            await client.health()
        assert refused == [1]
    finally:
        await client.close()
        await impostor.stop(grace=0)


async def test_without_a_secret_nothing_is_proven_or_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No secret: the server sends no proof, and a client naming a worker takes the
    answer of whatever serves the address, as before."""
    from runtime.rpc import auth

    handler = ScriptedHandler()
    server = await _start(monkeypatch, handler, "decode-b")
    client, refused = await _client_of(server.address, "decode-a")
    channel = grpc.aio.insecure_channel(server.address)
    try:
        await _all_four_calls(client, handler, "n")
        call = channel.unary_unary(HEALTH)(pb.HealthRequest().SerializeToString())
        await call
        assert auth.PROOF_KEY not in dict(await call.initial_metadata())
        assert refused == []
    finally:
        await channel.close()
        await client.close()
        await server.stop(grace=0)


def _pki(folder: Path, name: str) -> tuple[bytes, bytes, bytes]:
    """A CA and one certificate it signed for the name `diptych`: (ca, cert, key)."""
    import subprocess

    d = folder / name
    d.mkdir()

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}-ca",
        "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=diptych", "-keyout", "key.pem",
        "-out", "csr.pem")  # fmt: skip
    (d / "ext").write_text("subjectAltName=DNS:diptych\n")
    run("x509", "-req", "-in", "csr.pem", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "ext", "-out", "cert.pem")  # fmt: skip
    return tuple((d / n).read_bytes() for n in ("ca.pem", "cert.pem", "key.pem"))  # type: ignore[return-value]


async def test_over_mutual_tls_only_clients_of_the_deployment_ca_connect(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from runtime.rpc import auth

    ours, theirs = _pki(tmp_path, "ours"), _pki(tmp_path, "theirs")
    monkeypatch.setattr(auth, "_tls_files", lambda: ours)
    async with serve(ScriptedHandler()) as (server, client):
        assert [c.token_ids for c in await collect(client, req(n=1))] == [(100,), ()]
        # trusting our CA but with a certificate of another; another CA's; plain TCP
        for other in ((ours[0], theirs[1], theirs[2]), theirs, None):
            monkeypatch.setattr(auth, "_tls_files", lambda o=other: o)
            stranger = DecodeWorkerClient(server.address)
            await stranger.connect(wait=False)
            try:
                with pytest.raises(GenerateError) as e:
                    await collect(stranger, req(rid=f"s-{other is None}", n=1))
                assert e.value.code is ErrorCode.UNAVAILABLE
            finally:
                await stranger.close()
