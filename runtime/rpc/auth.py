"""Who may use the request plane, and over what.

TLS: with ``DIPTYCH_GRPC_TLS_DIR`` naming a directory of ``ca.pem``, ``cert.pem`` and
``key.pem``, workers serve gRPC over mutual TLS (a client must present a certificate the
CA signed) and clients verify the worker's certificate against the CA under the name
``diptych`` (its SAN; workers are dialled by pod IP, which certificates rarely name).
Without it, plain TCP.

The shared secret: with a deployment secret set
(``DIPTYCH_CLUSTER_SECRET``, or a file named by ``DIPTYCH_CLUSTER_SECRET_FILE``), every
gRPC call carries a token derived from it and every worker's server refuses a call
without it (UNAUTHENTICATED), so only processes of the deployment can generate on,
abort, or watch a worker. The token is an HMAC of the secret, never the secret itself
(the transfer layer keys its own proofs with the secret; see ``transfer/auth.py``).
"""

from __future__ import annotations

import functools
import hmac
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from runtime.secret import derived_key

METADATA_KEY = "x-diptych-auth"
TLS_NAME = "diptych"  # the name a worker's certificate must carry


@functools.cache
def request_token() -> str | None:
    """This process's token (the environment read once), or None without a secret."""
    key = derived_key("diptych request plane")
    return None if key is None else key.hex()


def call_metadata() -> tuple[tuple[str, str], ...] | None:
    """What a client sends with each call."""
    token = request_token()
    return None if token is None else ((METADATA_KEY, token),)


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


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    token = request_token()
    return [] if token is None else [_RequireToken(token)]


class _RequireToken(grpc.aio.ServerInterceptor):  # type: ignore[misc,unused-ignore]
    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if hmac.compare_digest(str(presented).encode(), self._token) or handler is None:
            return handler
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _deny_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            _deny, handler.request_deserializer, handler.response_serializer
        )


_REFUSAL = "this worker serves only its deployment (a missing or wrong cluster secret)"


async def _deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)


async def _deny_stream(
    request: Any, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)
    yield  # pragma: no cover - abort raises
