"""Prometheus helpers shared by every process: names, buckets, and the /metrics endpoint
(which also answers a worker's /health and /ready probes).

Every metric is named ``diptych_{component}_{name}`` (ARCHITECTURE.md). Each process
builds its metrics on its own :class:`CollectorRegistry` (``new_registry()``) rather
than the library's global one, so two components in one process, or in one test, never
collide.

The bucket edges are shared so that dashboards and the planner can compare histograms
across pools and versions; they are chosen around the latency targets of interactive
serving (TTFT of 0.1 to 2 s, ITL of 10 to 100 ms) with enough resolution on both sides of
those targets for SLA percentiles to interpolate well.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer

COMPONENTS = ("frontend", "worker", "transfer", "planner", "runtime")

# Seconds from request arrival to the first token.
TTFT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# Seconds between consecutive output tokens of one request.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
# Seconds from arrival to the last token.
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Prompt tokens of one request: 16 to 128k in half-octaves (the planner estimates the
# spread of prompt lengths, which sets how long prompts queue, from these buckets).
PROMPT_TOKEN_BUCKETS = tuple(float(round(16 * 2 ** (k / 2))) for k in range(27))
# Seconds for one KV transfer or one control-plane round trip (queue, discovery).
FAST_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def metric_name(component: str, name: str) -> str:
    """``diptych_{component}_{name}``; rejects unknown components and malformed names."""
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {COMPONENTS}, got {component!r}")
    if not _NAME.fullmatch(name):
        raise ValueError(f"metric name must match [a-z][a-z0-9_]*, got {name!r}")
    return f"diptych_{component}_{name}"


def histogram(
    registry: CollectorRegistry,
    component: str,
    name: str,
    doc: str,
    buckets: Sequence[float],
    labels: Sequence[str] = (),
) -> Histogram:
    return Histogram(
        metric_name(component, name), doc, labels, registry=registry, buckets=tuple(buckets)
    )


def counter(
    registry: CollectorRegistry, component: str, name: str, doc: str, labels: Sequence[str] = ()
) -> Counter:
    return Counter(metric_name(component, name), doc, labels, registry=registry)


def gauge(
    registry: CollectorRegistry, component: str, name: str, doc: str, labels: Sequence[str] = ()
) -> Gauge:
    return Gauge(metric_name(component, name), doc, labels, registry=registry)


def info(registry: CollectorRegistry, component: str, name: str, doc: str) -> Info:
    """A constant key/value metric (exported as ``diptych_{component}_{name}_info``)."""
    return Info(metric_name(component, name), doc, registry=registry)


@dataclass
class MetricsServer:
    """A running /metrics endpoint; ``address`` is ``host:port`` as bound."""

    address: str
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


# A probe: () -> (passing, detail); served as 200 or 503 with {"status": detail}.
Probe = Callable[[], tuple[bool, str]]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes and scrapes every few seconds: no access log."""


def _app(registry: CollectorRegistry, probes: Mapping[str, Probe]) -> Callable[..., Any]:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics(environ, start_response)  # type: ignore[no-any-return,unused-ignore]
        probe = probes.get(path)
        body: dict[str, Any]
        if probe is None:
            status, body = "404 Not Found", {"error": f"no {path}", "paths": ["/metrics", *probes]}
        else:
            ok, detail = probe()
            status, body = ("200 OK" if ok else "503 Service Unavailable"), {"status": detail}
        data = json.dumps(body).encode()
        start_response(
            status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))]
        )
        return [data]

    return app


def serve_metrics(
    registry: CollectorRegistry,
    host: str = "0.0.0.0",
    port: int = 0,
    probes: Mapping[str, Probe] | None = None,
    advertise_host: str | None = None,
) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread, and each
    of ``probes`` at its path (a worker's /health and /ready, for Kubernetes); any other
    path is a 404. Port 0 picks a free port; put the resulting ``address`` (with
    ``advertise_host`` in place of ``host`` if given) in the worker's discovery record."""
    server = make_server(
        host, port, _app(registry, dict(probes or {})), ThreadingWSGIServer, _QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    bound = server.server_address[1]
    return MetricsServer(f"{advertise_host or host}:{bound}", server, thread)
