"""OpenTelemetry traces of real `diptych serve` process trees (simulated engine).

A stand-in collector (tests/e2e/otlp_receiver.py) takes OTLP over HTTP from every role
(`--otlp-endpoint`). One streamed disaggregated chat is one trace: the frontend's server
span, an attempt, the decode worker's Generate, the queue wait, prefill and KV transfer
on the prefill worker, and the adopt on the decode worker, each under the one before,
their times splitting the time to first token. A decode worker killed mid-stream leaves
both workers in the one trace. Without an endpoint no role imports OpenTelemetry's SDK.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPORT
from tests.e2e.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.e2e.request_path import ROOT
from tests.e2e.serving import Server

pytestmark = pytest.mark.slow

SIM = ("--engine", "sim", "--sim-mean-output-tokens", "0")
LONG = " ".join(f"word{i}" for i in range(200))  # far over the remote-prefill threshold


def _chat(url: str, text: str, request_id: str, max_tokens: int = 8) -> tuple[float, str]:
    """Stream a chat; (seconds to the first token, the SSE text)."""
    body = {
        "model": "Llama-3.1-8B",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started, first, out = time.monotonic(), None, []
    headers = {"x-request-id": request_id}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            out.append(line)
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.monotonic() - started
    assert first is not None, out
    return first, "\n".join(out)


def _trace_of(spans: list[ReceivedSpan], request_id: str) -> list[ReceivedSpan]:
    roots = [s for s in spans if s.attributes.get("diptych.http_request_id") == request_id]
    assert len(roots) == 1, [(s.service, s.name, s.attributes) for s in spans]
    return [s for s in spans if s.trace_id == roots[0].trace_id]


def test_a_disaggregated_request_is_one_trace_splitting_its_ttft(tmp_path: Path) -> None:
    with OtlpReceiver() as otlp:
        server = Server(
            tmp_path, *SIM, "--profile", "fixed:20ms", "--prefill-workers", "1",
            "--decode-workers", "1", "--min-remote-prefill-tokens", "16",
            "--otlp-endpoint", otlp.url,
        )  # fmt: skip
        try:
            _chat(server.url, "Warm up. " + LONG, "warm-up")  # every hop connected
            rid = uuid.uuid4().hex
            ttft, _ = _chat(server.url, "Traced. " + LONG, rid)
        finally:
            assert server.stop() == 0, "".join(server.log[-30:])  # flushes every role
        trace = _trace_of(otlp.spans(), rid)

    def one(service: str, name: str) -> ReceivedSpan:
        found = [s for s in trace if s.service == service and s.name == name]
        assert len(found) == 1, (service, name, [(s.service, s.name) for s in trace])
        return found[0]

    root = one("diptych-frontend", "POST /v1/chat/completions")
    attempt = one("diptych-frontend", "attempt")
    generate = one("diptych-decode", "generate")
    queue, prefill, transfer = (one("diptych-prefill", n) for n in ("queue", "prefill", "transfer"))
    adopt = one("diptych-decode", "adopt")
    assert root.parent_id == "" and root.attributes["http.response.status_code"] == 200
    assert attempt.parent_id == root.span_id
    assert attempt.attributes["diptych.worker_id"] == "decode-0"
    assert generate.parent_id == attempt.span_id
    assert generate.attributes["diptych.remote_prefill"] is True
    for s in (queue, prefill, transfer):
        assert s.parent_id == generate.span_id, s
        assert s.attributes["diptych.worker_id"] == "prefill-0"
        assert s.attributes["diptych.delivery"] == 1
    assert adopt.parent_id == transfer.span_id  # the notice carried the transfer's context
    prompt = generate.attributes["diptych.prompt_tokens"]
    assert prefill.attributes["diptych.prompt_tokens"] == prompt
    assert transfer.attributes["diptych.blocks"] > 0 and transfer.attributes["diptych.bytes"] > 0
    assert not any(s.error for s in trace), [(s.service, s.name, s.error) for s in trace if s.error]

    # TTFT split: queue -> prefill -> transfer -> adopt, one after the other, inside the
    # request's span, together no longer than the client's time to first token. The
    # transfer ends when the prefill worker hears its write landed, which the decode
    # worker's transfer thread answers as the notice arrives; adopt starts when the decode
    # worker's event loop takes the notice, so it may begin before or (on a busy machine,
    # milliseconds) after the transfer's end, never before the transfer's start.
    split = (queue, prefill, transfer, adopt)
    slack = 2_000_000  # 2 ms: published_at crosses processes as a float of seconds
    for a, b in itertools.pairwise(split[:3]):
        assert a.end_ns <= b.start_ns + slack, (a.name, b.name)
    assert transfer.start_ns <= adopt.start_ns
    assert all(s.end_ns >= s.start_ns for s in split)
    assert root.start_ns <= queue.start_ns + slack and adopt.end_ns <= root.end_ns
    landed = (adopt.start_ns - transfer.start_ns) / 1e9  # write start -> notice received
    total = queue.seconds + prefill.seconds + landed + adopt.seconds
    assert 0 < total <= ttft, (total, ttft)
    assert (adopt.end_ns - queue.start_ns) / 1e9 <= ttft
    assert prefill.seconds >= 0.015  # one simulated 20 ms step
    REPORT["tracing: TTFT split (queue/prefill/transfer to notice/adopt ms, of TTFT)"] = (
        " / ".join(f"{t * 1e3:.1f}" for t in (queue.seconds, prefill.seconds, landed,
                                                 adopt.seconds)) + f" of {ttft * 1e3:.0f}"
    )


def test_a_migrated_request_keeps_both_decode_workers_in_its_trace(tmp_path: Path) -> None:
    with OtlpReceiver() as otlp:
        server = Server(
            tmp_path, *SIM, "--profile", "fixed:50ms", "--prefill-workers", "0",
            "--decode-workers", "2", "--otlp-endpoint", otlp.url,
        )  # fmt: skip
        rid = uuid.uuid4().hex
        body = {"model": "Llama-3.1-8B", "messages": [{"role": "user", "content": "Go on."}],
                "max_tokens": 60, "temperature": 0, "stream": True}  # fmt: skip
        try:
            contents, victim, lines = 0, None, []
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                              headers={"x-request-id": rid}, timeout=120) as r:  # fmt: skip
                assert r.status_code == 200
                for line in r.iter_lines():
                    lines.append(line)
                    contents += '"content":"' in line
                    if contents == 5 and victim is None:
                        victim = next(
                            c for c in ("decode-0", "decode-1")
                            if server.metrics(c).get("diptych_worker_running_requests", 0) > 0
                        )  # fmt: skip
                        os.kill(server.manifest[victim]["pid"], signal.SIGKILL)
            assert victim is not None
            assert any('"finish_reason":"length"' in line for line in lines), lines[-5:]
        finally:
            assert server.stop() == 0, "".join(server.log[-30:])
        trace = _trace_of(otlp.spans(), rid)

    survivor = "decode-1" if victim == "decode-0" else "decode-0"
    attempts = sorted(
        (s for s in trace if s.name == "attempt"), key=lambda s: s.attributes["diptych.attempt"]
    )
    assert [a.attributes["diptych.worker_id"] for a in attempts] == [victim, survivor]
    assert attempts[0].error and attempts[0].attributes["diptych.failover"] == "migration"
    assert attempts[1].attributes["diptych.replayed_tokens"] > 0
    # the killed worker never exported its spans; the survivor's Generate is in the trace,
    # under the second attempt
    served = [s for s in trace if s.service == "diptych-decode" and s.name == "generate"]
    assert [s.attributes["diptych.worker_id"] for s in served] == [survivor]
    assert served[0].parent_id == attempts[1].span_id


def test_without_an_endpoint_no_role_imports_the_sdk() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-m", "tests.e2e.tracing_off"], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "served; opentelemetry.sdk modules: []"
