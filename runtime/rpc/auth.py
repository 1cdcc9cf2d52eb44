"""Who may use the request plane, and over what.

TLS: with ``DIPTYCH_GRPC_TLS_DIR`` naming a directory of ``ca.pem``, ``cert.pem`` and
``key.pem``, workers serve gRPC over mutual TLS (a client must present a certificate the
CA signed) and clients verify the worker's certificate against the CA under the name
``diptych`` (its SAN; workers are dialled by pod IP, which certificates rarely name).
Without it, plain TCP.

The shared secret: with a deployment secret set
(``DIPTYCH_CLUSTER_SECRET``, or a file named by ``DIPTYCH_CLUSTER_SECRET_FILE``), every
gRPC call carries a token of its own and every worker's server refuses a call without a
valid one (UNAUTHENTICATED), so only processes of the deployment can generate on, abort,
or watch a worker. A token is ``v2.<unix seconds>.<nonce>.<mac>``, the MAC an
HMAC-SHA256 over the method, the time and a 128-bit nonce under the request plane's key
(derived from the secret, ``runtime/secret.py``). A server accepts a token within
``WINDOW_S`` of its own clock and only once (it remembers the nonces it took for twice
the window), so a token recorded on the wire is worth nothing: it was used, and it
expires. (It was one static value per deployment, valid for any call, forever.)

The answer is proven too: a server that knows its worker id (its discovery id) and
accepts a call's token first sends the initial metadata ``x-diptych-proof``, an
HMAC-SHA256 over the method, that worker id and the nonce of the caller's token under a
key of its own (``diptych worker answer``). A client that names the worker it means to
call (the frontend and the decode worker do, from the discovery record) checks it
before it takes the first message or the unary result, so an address pointed at another
server (discovery written by an attacker, a port reused by another process, even one of
the same deployment) is refused: the answer must come from a holder of the secret, for
this call (the nonce is the client's, fresh each call), as that worker. A refusal is an
UNAVAILABLE :class:`~runtime.rpc.types.GenerateError` (the frontend tries another
worker). Errors are not proven: a server that fails a call is not trusted for anything
but the failure, which anyone on the path could cause.
Without TLS the calls themselves are still readable on the wire: set
``DIPTYCH_GRPC_TLS_DIR`` where the network is not trusted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from runtime.secret import derived_key

METADATA_KEY = "x-diptych-auth"
PROOF_KEY = "x-diptych-proof"  # the server's initial metadata: who answers
TLS_NAME = "diptych"  # the name a worker's certificate must carry


WINDOW_S = 60.0  # how far a token's time may be from the server's clock
MAX_NONCES = 2_000_000  # a bound on the server's memory of used tokens


@functools.cache
def call_key() -> bytes | None:
    """The request plane's key (the environment read once), or None without a secret."""
    return derived_key("diptych request plane")


@functools.cache
def answer_key() -> bytes | None:
    """The key of the workers' answer proofs (the environment read once), or None."""
    return derived_key("diptych worker answer")


def answer_proof(key: bytes, method: str, worker_id: str, nonce: str) -> str:
    """What worker ``worker_id`` sends when it takes a call of ``method`` whose token
    carries ``nonce``."""
    text = f"{method}\0{worker_id}\0{nonce}".encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def _nonce_of(token: str) -> str | None:
    parts = token.split(".")  # v2.<stamp>.<nonce>.<mac>
    return parts[2] if len(parts) == 4 else None


def token_nonce(metadata: Sequence[tuple[str, str]] | None) -> str | None:
    """The nonce of the call token in a call's metadata, or None if it carries none."""
    for k, v in metadata or ():
        if k == METADATA_KEY:
            return _nonce_of(v)
    return None


def answer_verified(
    initial_metadata: Iterable[tuple[str, str | bytes]] | None,
    method: str,
    worker_id: str,
    nonce: str,
) -> bool:
    """Whether a call's initial metadata proves that ``worker_id`` took it (the call
    sent with a token carrying ``nonce``). False without an answer key."""
    key = answer_key()
    if key is None:
        return False
    presented = [v for k, v in initial_metadata or () if k == PROOF_KEY]
    if len(presented) != 1 or not isinstance(presented[0], str):
        return False
    return hmac.compare_digest(answer_proof(key, method, worker_id, nonce), presented[0])


def _mac(key: bytes, method: str, stamp: str, nonce: str) -> str:
    text = f"{method}\0{stamp}\0{nonce}".encode()
    return hmac.new(key, text, hashlib.sha256).hexdigest()


def call_token(key: bytes, method: str, now: float | None = None) -> str:
    stamp, nonce = str(int(time.time() if now is None else now)), secrets.token_hex(16)
    return f"v2.{stamp}.{nonce}.{_mac(key, method, stamp, nonce)}"


def call_metadata(key: bytes, method: str) -> tuple[tuple[str, str], ...]:
    """What a client holding the request plane's ``key`` (`call_key`) sends with one
    call of ``method`` (``/<service>/<name>``): a fresh token."""
    return ((METADATA_KEY, call_token(key, method)),)


class TokenCheck:
    """A server's check of call tokens: well-formed, MAC'd, in the window, unused."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seen: OrderedDict[str, float] = OrderedDict()

    def accepts(self, method: str, token: str, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        parts = token.split(".")
        if len(parts) != 4 or parts[0] != "v2" or not parts[1].isdigit():
            return False
        _, stamp, nonce, mac = parts
        if abs(now - int(stamp)) > WINDOW_S or len(nonce) != 32:
            return False
        if not hmac.compare_digest(_mac(self._key, method, stamp, nonce), mac):
            return False
        while self._seen and next(iter(self._seen.values())) < now - 2 * WINDOW_S:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return False  # a replay
        self._seen[nonce] = now
        if len(self._seen) > MAX_NONCES:
            self._seen.popitem(last=False)
        return True


@functools.cache
def _tls_files() -> tuple[bytes, bytes, bytes] | None:
    folder = os.environ.get("DIPTYCH_GRPC_TLS_DIR")
    if not folder:
        return None
    ca, cert, key = (Path(folder, n).read_bytes() for n in ("ca.pem", "cert.pem", "key.pem"))
    return ca, cert, key


def server_credentials() -> grpc.ServerCredentials | None:
    files = _tls_files()
    if files is None:
        return None
    ca, cert, key = files
    return grpc.ssl_server_credentials([(key, cert)], ca, require_client_auth=True)


def client_channel(address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    files = _tls_files()
    if files is None:
        return grpc.aio.insecure_channel(address, options=options)
    ca, cert, key = files
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    named = [*options, ("grpc.ssl_target_name_override", TLS_NAME)]
    return grpc.aio.secure_channel(address, creds, options=named)


def server_interceptors(worker_id: str | None = None) -> list[grpc.aio.ServerInterceptor]:
    """The cluster secret's check of every call, if one is set; with ``worker_id``, each
    call taken also gets this worker's answer proof."""
    key = call_key()
    if key is None:
        return []
    proof_key = answer_key()  # set whenever call_key is: both derive from the secret
    identity = None if worker_id is None or proof_key is None else (proof_key, worker_id)
    return [_RequireToken(TokenCheck(key), identity)]


class _RequireToken(grpc.aio.ServerInterceptor):  # type: ignore[misc,unused-ignore]
    def __init__(self, check: TokenCheck, identity: tuple[bytes, str] | None = None) -> None:
        self._check = check
        self._identity = identity  # (answer key, worker id): prove each answer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        presented = str(dict(details.invocation_metadata or ()).get(METADATA_KEY, ""))
        if handler is None:
            return handler
        if self._check.accepts(details.method, presented):
            if self._identity is None:
                return handler
            key, worker_id = self._identity
            nonce = _nonce_of(presented)  # an accepted token is well-formed
            assert nonce is not None
            proof = answer_proof(key, details.method, worker_id, nonce)
            return _proving(handler, ((PROOF_KEY, proof),))
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _deny_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            _deny, handler.request_deserializer, handler.response_serializer
        )


def _proving(handler: grpc.RpcMethodHandler, proof: tuple[tuple[str, str], ...]) -> Any:
    """``handler`` sending ``proof`` as its initial metadata before anything else."""
    if handler.unary_stream is not None:
        stream = handler.unary_stream

        async def proving_stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            await context.send_initial_metadata(proof)
            async with contextlib.aclosing(stream(request, context)) as responses:
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(
            proving_stream, handler.request_deserializer, handler.response_serializer
        )
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def proving(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await context.send_initial_metadata(proof)
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            proving, handler.request_deserializer, handler.response_serializer
        )
    return handler  # streaming requests: this service has none


_REFUSAL = (
    "this worker serves only its deployment (a missing, wrong, expired or replayed call "
    "token: check the cluster secret and the clocks)"
)


async def _deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)


async def _deny_stream(
    request: Any, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
    yield  # pragma: no cover - abort raises
