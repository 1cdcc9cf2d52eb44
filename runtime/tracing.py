"""OpenTelemetry traces of a request across the roles; off, and free, unless asked for.

One request is one trace, whatever processes it crosses. Each hop carries the W3C trace
context as a ``traceparent`` string (``00-<trace id>-<span id>-<flags>``): the frontend
to the decode worker in the Generate call's metadata, the decode worker to the prefill
worker in the queue message, the prefill worker back in the prefill notice.

    tracer = open_tracer(config.otlp_endpoint, "diptych-decode", instance="decode-0")
    span = tracer.start("generate", parent=traceparent, kind="server")
    span.set("diptych.request_id", rid)
    send(span.traceparent)               # the next hop's parent
    span.end()
    tracer.close()                       # flushes what is batched (blocking: a thread)

Without an endpoint (no ``--otlp-endpoint``, no ``OTEL_EXPORTER_OTLP_*ENDPOINT``) the
tracer is :data:`NO_TRACER`: ``start`` returns :data:`NO_SPAN`, whose methods return at
once and whose ``traceparent`` is ``""`` (nothing is carried), and no OpenTelemetry
module is imported. With one, spans go to ``<endpoint>/v1/traces`` as OTLP over
HTTP/protobuf through a batching processor, from this process's own tracer provider (the
global one is left alone, so a library's instrumentation is not switched on with ours).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import Any

Attributes = Mapping[str, str | int | float | bool]

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
MAX_TRACEPARENT = 55  # the length of a version-00 traceparent


class Span:
    """A span that records nothing: what every method of a tracer that is off returns."""

    traceparent = ""  # the W3C context to carry to the next hop; "" carries nothing
    recording = False

    def child(
        self,
        name: str,
        attributes: Attributes | None = None,
        *,
        start_s: float | None = None,
        kind: str = "internal",
    ) -> Span:
        """A span under this one, in the same process."""
        return self

    def set(self, key: str, value: str | int | float | bool) -> None:
        """Set an attribute."""

    def error(self, message: str) -> None:
        """Mark the span failed, saying why."""

    def end(self, end_s: float | None = None) -> None:
        """End it (at ``end_s``, unix seconds, if given); later calls do nothing."""


NO_SPAN = Span()


class Tracer:
    """A tracer that is off: see the module's docstring."""

    on = False

    def start(
        self,
        name: str,
        parent: str = "",
        attributes: Attributes | None = None,
        *,
        start_s: float | None = None,
        kind: str = "internal",
    ) -> Span:
        """A span under ``parent`` (a traceparent; "" or malformed: a new trace) starting
        now or at ``start_s`` (unix seconds, for a start seen by another process).
        ``kind``: internal, server, client, producer or consumer."""
        return NO_SPAN

    def close(self) -> None:
        """Export what is batched and stop (blocks up to the exporter's timeout)."""


NO_TRACER = Tracer()


def endpoint_from(flag: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The OTLP/HTTP traces URL: ``--otlp-endpoint`` (a collector's base URL, e.g.
    ``http://collector:4318``, to which ``/v1/traces`` is added, or that full URL), else
    the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (used as is) or
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base); None: tracing is off."""
    env = os.environ if env is None else env
    if flag:
        return _traces_url(flag)
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _traces_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    return None


def _traces_url(base: str) -> str:
    base = base.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def open_tracer(flag: str | None, service: str, *, instance: str | None = None) -> Tracer:
    """This process's tracer for ``service`` (``service.name``; ``instance``, the worker
    id, is ``service.instance.id``): :data:`NO_TRACER` without an endpoint."""
    url = endpoint_from(flag)
    if url is None:
        return NO_TRACER
    return _OtelTracer(url, service, instance)


def parse_traceparent(value: str) -> tuple[int, int, int] | None:
    """(trace id, span id, flags) of a version-00 traceparent; None if it is not one
    (W3C: an all-zero trace or span id is invalid)."""
    m = _TRACEPARENT.fullmatch(value.strip().lower()) if len(value) <= 64 else None
    if m is None:
        return None
    trace_id, span_id, flags = (int(g, 16) for g in m.groups())
    return (trace_id, span_id, flags) if trace_id and span_id else None


def _ns(unix_s: float | None) -> int | None:
    return None if unix_s is None else int(unix_s * 1e9)


class _OtelSpan(Span):
    recording = True

    def __init__(self, tracer: _OtelTracer, span: Any) -> None:
        self._tracer = tracer
        self._span = span
        self._ended = False
        ctx = span.get_span_context()
        self.traceparent = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def child(
        self,
        name: str,
        attributes: Attributes | None = None,
        *,
        start_s: float | None = None,
        kind: str = "internal",
    ) -> Span:
        return self._tracer.start(name, self.traceparent, attributes, start_s=start_s, kind=kind)

    def set(self, key: str, value: str | int | float | bool) -> None:
        self._span.set_attribute(key, value)

    def error(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, message))

    def end(self, end_s: float | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._span.end(end_time=_ns(end_s))


class _OtelTracer(Tracer):
    on = True

    def __init__(self, url: str, service: str, instance: str | None) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            raise RuntimeError(
                f"tracing to {url} needs OpenTelemetry's SDK and OTLP exporter: "
                f"pip install 'diptych[tracing]' ({e})"
            ) from None
        from opentelemetry import trace

        attrs = {"service.name": service}
        if instance:
            attrs["service.instance.id"] = instance
        self._provider = TracerProvider(resource=Resource.create(attrs), shutdown_on_exit=False)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self._tracer = self._provider.get_tracer("diptych")
        self._trace = trace
        k = trace.SpanKind
        self._kinds = {"internal": k.INTERNAL, "server": k.SERVER, "client": k.CLIENT,
                       "producer": k.PRODUCER, "consumer": k.CONSUMER}  # fmt: skip
        self.url = url

    def start(
        self,
        name: str,
        parent: str = "",
        attributes: Attributes | None = None,
        *,
        start_s: float | None = None,
        kind: str = "internal",
    ) -> Span:
        t = self._trace
        context = None
        ids = parse_traceparent(parent) if parent else None
        if ids is not None:
            trace_id, span_id, flags = ids
            remote = t.SpanContext(trace_id, span_id, is_remote=True,
                                   trace_flags=t.TraceFlags(flags & 0xFF))  # fmt: skip
            context = t.set_span_in_context(t.NonRecordingSpan(remote))
        span = self._tracer.start_span(
            name, context=context, kind=self._kinds[kind], attributes=attributes,
            start_time=_ns(start_s) if start_s is not None else time.time_ns(),
        )  # fmt: skip
        return _OtelSpan(self, span)

    def close(self) -> None:
        self._provider.shutdown()
