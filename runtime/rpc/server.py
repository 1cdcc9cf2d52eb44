"""A worker's gRPC server: Health and Events over any worker's handler, and Generate and
Abort over a decode worker's.

A decode worker implements :class:`GenerateHandler` on top of its engine and runs it with
:class:`DecodeWorkerServer`; a prefill worker serves a :class:`WorkerHandler` (its events
and health) with the same server, which then has no Generate (a call is UNIMPLEMENTED).
The protocol itself lives in ``servicer.py``, the limits and their reasons in ``limits.py``.
"""

from __future__ import annotations

import grpc
import grpc.aio

from runtime.rpc.auth import server_credentials, server_interceptors
from runtime.rpc.handler import GenerateHandler, WorkerHandler
from runtime.rpc.limits import ServerLimits
from runtime.rpc.servicer import SERVICE, Servicer
from runtime.tracing import NO_TRACER, Tracer

__all__ = ["SERVICE", "DecodeWorkerServer", "GenerateHandler", "WorkerHandler"]


def _identity(data: bytes) -> bytes:
    return data


class DecodeWorkerServer:
    """Serve a worker's handler. ``address`` may use port 0; see :attr:`address`.
    ``worker_id`` is the worker's discovery id, which its answers prove (``auth.py``)."""

    def __init__(
        self,
        handler: WorkerHandler,
        address: str = "127.0.0.1:0",
        limits: ServerLimits | None = None,
        worker_id: str | None = None,
        tracer: Tracer = NO_TRACER,
    ) -> None:
        self.limits = limits or ServerLimits()
        self.worker_id = worker_id  # proven in every answer when a secret is set
        self._servicer = Servicer(handler, self.limits, tracer, worker_id)
        self._requested = address
        self._server: grpc.aio.Server | None = None
        self.address = address

    @property
    def requests_in_flight(self) -> int:
        return len(self._servicer.in_flight)

    async def start(self) -> str:
        """Bind and start serving; returns ``host:port`` with the port actually bound."""
        s = self._servicer
        handlers = {
            "Health": grpc.unary_unary_rpc_method_handler(s.health, _identity, _identity),
            "Events": grpc.unary_stream_rpc_method_handler(s.events, _identity, _identity),
        }
        if s.generator is not None:  # the request plane: a decode worker's
            handlers["Generate"] = grpc.unary_stream_rpc_method_handler(
                s.generate, _identity, _identity
            )
            handlers["Abort"] = grpc.unary_unary_rpc_method_handler(s.abort, _identity, _identity)
        server = grpc.aio.server(
            options=self.limits.server_options(),
            maximum_concurrent_rpcs=self.limits.max_concurrent_rpcs,
            interceptors=server_interceptors(self.worker_id),  # the cluster secret, if set
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            creds = server_credentials()
            if creds is None:
                port = server.add_insecure_port(self._requested)
            else:
                port = server.add_secure_port(self._requested, creds)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot bind the gRPC server to {self._requested} (port in use?)")
        await server.start()
        self._server = server
        host = self._requested.rpartition(":")[0]
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self, grace: float | None = 5.0) -> None:
        """Refuse new calls, give running ones ``grace`` seconds, then cancel them."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
