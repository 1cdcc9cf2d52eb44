"""runtime/tracing.py: the no-op tracer, the traceparent format, the endpoint, and the
trace context on the wire (the Generate call's metadata, the queue message, the notice).
The spans across real processes: tests/e2e/test_tracing.py."""

from __future__ import annotations

import dataclasses
import timeit

import pytest

from protocol.sampling import SamplingParams
from runtime.queue.messages import PrefillNotice, RemotePrefillRequest
from runtime.rpc import types as wire
from runtime.rpc.types import GenerateRequest
from runtime.tracing import (
    NO_SPAN,
    NO_TRACER,
    endpoint_from,
    open_tracer,
    parse_traceparent,
)
from tests.conftest import REPORT
from tests.runtime.rt_helpers import queue, request

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_off_is_a_no_op_that_carries_nothing() -> None:
    assert open_tracer(None, "diptych-test") is NO_TRACER or endpoint_from(None) is not None
    span = NO_TRACER.start("x", TP, {"a": 1}, start_s=1.0, kind="server")
    assert span is NO_SPAN and span.traceparent == "" and not span.recording
    assert span.child("y") is NO_SPAN
    span.set("k", 1)
    span.error("no")
    span.end()
    span.end()
    # what a request pays when tracing is off: a few of these calls, per request
    n = 100_000
    cost = timeit.timeit(lambda: NO_TRACER.start("attempt", "", {"a": 1}).end(), number=n) / n
    REPORT["tracing off: a span start + end"] = f"{cost * 1e9:.0f} ns"
    assert cost < 20e-6


def test_traceparent_parsing() -> None:
    assert parse_traceparent(TP) == (
        0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1,
    )  # fmt: skip
    zero_trace = "00-" + "0" * 32 + "-00f067aa0ba902b7-01"
    zero_span = "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01"
    other_version = TP.replace("00-", "ff-", 1)
    for bad in ("", "garbage", other_version, TP[:-1], zero_trace, zero_span, TP + "x" * 20):
        assert parse_traceparent(bad) is None, bad


def test_the_endpoint_is_the_flag_else_the_standard_variables() -> None:
    assert endpoint_from("http://c:4318", {}) == "http://c:4318/v1/traces"
    assert endpoint_from("http://c:4318/v1/traces", {}) == "http://c:4318/v1/traces"
    assert endpoint_from(None, {}) is None
    assert endpoint_from(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://e:4318/"}) == (
        "http://e:4318/v1/traces"
    )
    both = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://e",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x",
    }
    assert endpoint_from(None, both) == "http://t/x"
    assert endpoint_from(None, {**both, "OTEL_SDK_DISABLED": "true"}) is None
    assert endpoint_from("http://c", {"OTEL_SDK_DISABLED": "true"}) == "http://c/v1/traces"


def test_a_real_tracer_continues_the_callers_trace() -> None:
    pytest.importorskip("opentelemetry.sdk")
    tracer = open_tracer("http://127.0.0.1:9", "diptych-test")  # nothing listens: never sent
    assert tracer.on
    span = tracer.start("generate", TP, kind="server")
    trace_id, span_id, flags = parse_traceparent(span.traceparent) or (0, 0, 0)
    assert trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736 and span_id != 0x00F067AA0BA902B7
    assert flags == 1
    child = span.child("adopt", start_s=1.0)
    assert parse_traceparent(child.traceparent)[0] == trace_id  # type: ignore[index]
    root = tracer.start("root", "not a traceparent")  # a new trace
    assert parse_traceparent(root.traceparent)[0] != trace_id  # type: ignore[index]
    for s in (child, span, root):
        s.end()
        s.end()  # once only


def test_the_trace_context_on_the_wire() -> None:
    # Generate: beside the message (the call's metadata), never in it
    req = GenerateRequest("r1", (1, 2, 3), SamplingParams(), traceparent=TP)
    back = wire.request_from_bytes(wire.request_to_bytes(req))
    assert back.traceparent == "" and back == req
    assert wire.request_from_bytes(wire.request_to_bytes(req), TP).traceparent == TP
    # the queue message carries it, so every delivery's spans join the trace
    msg = RemotePrefillRequest(
        request_id="r1", prompt_token_ids=(1, 2, 3), sampling=SamplingParams(),
        decode_worker_id="decode-0", decode_incarnation_id="i", transfer_agent="a",
        dst_block_ids=(1,), num_cached_tokens=0, deadline=2e9, kv_layout_hash="h",
        traceparent=TP,
    )  # fmt: skip
    assert RemotePrefillRequest.decode(msg.encode()).traceparent == TP
    # the notice: left out when empty (the same bytes as before tracing), read when there
    plain = PrefillNotice("r1", ok=True, first_token=5)
    assert b"traceparent" not in plain.encode()
    assert PrefillNotice.decode(plain.encode()).traceparent == ""
    traced = PrefillNotice("r1", ok=True, first_token=5, traceparent=TP)
    assert PrefillNotice.decode(traced.encode()).traceparent == TP
    with pytest.raises(ValueError):
        GenerateRequest("r1", (1,), traceparent="x" * 65)


async def test_a_redelivery_carries_the_same_trace_context(queue_url: str, namespace: str) -> None:
    """A second delivery's spans (tries of a crashed or slow prefill) join the same trace."""
    async with queue(queue_url, namespace) as q:
        await q.publish(dataclasses.replace(request(1), traceparent=TP))
        [d] = await q.fetch(1, timeout=2.0)
        await d.nak()
        [again] = await q.fetch(1, timeout=2.0)
        assert again.num_delivered == 2
        assert again.request.traceparent == d.request.traceparent == TP
        await again.ack()
