"""The load generator end to end against a stub OpenAI server with scripted timing."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import build_parser, config_from_args, run_benchmark
from bench.workloads import PromptBuilder
from diptych.cli import main as diptych_main
from tests.bench.stub_server import StubConfig, StubServer

VLLM_KEYS = {
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "latencies",
    "queue_times",
    *(
        f"{s}_{m}_ms"
        for s in ("mean", "median", "std", "p50", "p90", "p95", "p99")
        for m in ("ttft", "tpot", "itl", "e2el")
    ),
}


def run(stub: StubServer, builder: PromptBuilder, *flags: str) -> list[dict[str, Any]]:
    args = build_parser().parse_args(["--base-url", stub.url, "--disable-tqdm", *flags])
    return asyncio.run(run_benchmark(config_from_args(args), builder))


def test_fixed_lengths_at_max_concurrency(stub: StubServer, builder: PromptBuilder) -> None:
    [doc] = run(
        stub,
        builder,
        "--num-prompts",
        "20",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--max-concurrency",
        "4",
        "--temperature",
        "0",
    )
    assert (doc["completed"], doc["failed"]) == (20, 0)
    assert doc["total_input_tokens"] == 20 * 16  # the stub counts words: prompts are exact
    assert doc["total_output_tokens"] == 20 * 8
    assert stub.state.peak_in_flight <= 4 and doc["max_concurrent_requests"] <= 4
    assert doc["max_concurrent_requests"] >= 2
    body = stub.state.seen[0].body
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 8
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "stub-model"
    # The stub waits 50 ms, then sends 8 events 5 ms apart.
    assert 50 <= doc["median_ttft_ms"] < 1000  # loose: CI machines are shared
    assert 5 <= doc["median_itl_ms"] < 500
    assert doc["median_tpot_ms"] == pytest.approx(doc["mean_itl_ms"], rel=0.5)
    assert doc["median_e2el_ms"] >= 50 + 7 * 5
    assert doc["request_goodput"] is None
    assert set(doc) >= VLLM_KEYS


def test_failed_requests_are_counted_apart(
    stub: StubServer, builder: PromptBuilder, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.txt"
    lines = ["ok one", "FAIL now", "ok two", "BREAK mid stream", "ok three", "ok four"]
    prompts.write_text("\n".join(lines) + "\n")
    [doc] = run(
        stub,
        builder,
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(prompts),
        "--custom-output-len",
        "4",
        "--num-prompts",
        "6",
        "--save-detailed",
    )
    assert (doc["completed"], doc["failed"]) == (4, 2)
    errors = [e for e in doc["errors"] if e]
    assert any("HTTP 500" in e for e in errors)
    assert any("scripted mid-stream error" in e for e in errors)
    assert doc["total_output_tokens"] == 16 and len(doc["latencies"]) == 6
    assert doc["output_lens"] == [4, 0, 4, 0, 4, 4]


def test_request_rate_paces_arrivals(stub: StubServer, builder: PromptBuilder) -> None:
    [doc] = run(
        stub,
        builder,
        "--num-prompts",
        "12",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
        "--request-rate",
        "20",
        "--seed",
        "5",
    )
    arrivals = sorted(s.arrived for s in stub.state.seen)
    assert arrivals[-1] - arrivals[0] == pytest.approx(12 / 20, abs=0.25)
    assert doc["request_rate"] == 20.0 and doc["burstiness"] == 1.0


def test_multiturn_turns_wait_for_the_previous_turn(
    stub: StubServer, builder: PromptBuilder
) -> None:
    [doc] = run(
        stub,
        builder,
        "--dataset-name",
        "multiturn",
        "--num-prompts",
        "6",
        "--multiturn-turns",
        "3",
        "--multiturn-system-len",
        "16",
        "--multiturn-user-len",
        "8",
        "--multiturn-output-len",
        "4",
        "--multiturn-think-time",
        "0.05",
    )
    assert doc["completed"] == 6 and set(doc["per_tag"]) == {"turn1", "turn2", "turn3"}
    by_prompt = sorted(stub.state.seen, key=lambda s: len(s.body["prompt"]))
    for later in by_prompt:
        earlier = [
            s
            for s in stub.state.seen
            if later.body["prompt"].startswith(s.body["prompt"]) and s is not later
        ]
        for e in earlier:
            assert later.arrived >= e.ended + 0.04  # after its predecessor, plus think time


def test_session_header_names_each_conversation(stub: StubServer, builder: PromptBuilder) -> None:
    [doc] = run(
        stub, builder, "--dataset-name", "multiturn", "--num-prompts", "6",
        "--multiturn-turns", "2", "--multiturn-system-len", "16", "--multiturn-user-len", "8",
        "--multiturn-output-len", "4", "--session-header",
    )  # fmt: skip
    assert doc["completed"] == 6
    by_session: dict[str | None, list[str]] = {}
    for s in stub.state.seen:
        by_session.setdefault(s.session, []).append(s.body["prompt"])
    assert None not in by_session and len(by_session) == 3
    for prompts in by_session.values():  # a session's turns: each holds the one before
        first, second = sorted(prompts, key=len)
        assert second.startswith(first)


def test_chat_backend_sends_messages(stub: StubServer, builder: PromptBuilder) -> None:
    [doc] = run(
        stub,
        builder,
        "--backend",
        "openai-chat",
        "--num-prompts",
        "3",
        "--random-input-len",
        "8",
        "--random-output-len",
        "3",
    )
    assert doc["completed"] == 3 and doc["total_output_tokens"] == 9
    body = stub.state.seen[0].body
    assert body["messages"][0]["role"] == "user" and "prompt" not in body


def test_without_usage_the_tokenizer_counts(builder: PromptBuilder) -> None:
    with StubServer(StubConfig(usage=False)) as stub:
        [doc] = run(
            stub,
            builder,
            "--num-prompts",
            "2",
            "--random-input-len",
            "8",
            "--random-output-len",
            "5",
        )
    assert doc["total_output_tokens"] == 2 * builder.count(" tok" * 5)
    assert doc["total_input_tokens"] == 16  # the workload's own counts


def test_sweep_writes_json_per_rate_summary_and_plot(
    stub: StubServer, builder: PromptBuilder, tmp_path: Path
) -> None:
    docs = run(
        stub,
        builder,
        "--num-prompts",
        "8",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--request-rate",
        "40,inf",
        "--label",
        "stub",
        "--goodput",
        "ttft:5000",
        "tpot:1000",
        "--result-dir",
        str(tmp_path),
    )
    assert [d["request_rate"] for d in docs] == [40.0, "inf"]
    assert all(d["request_goodput"] == pytest.approx(d["request_throughput"]) for d in docs)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len([f for f in files if "qps" in f]) == 2
    assert any(f.startswith("stub-40.0qps-stub-model-") for f in files)
    assert any(f.startswith("stub-infqps-stub-model-") for f in files)
    summary = json.loads(next(tmp_path.glob("stub-sweep-*.json")).read_text())
    assert summary["operating_point"] in (40.0, "inf")
    assert [r["request_rate"] for r in summary["runs"]] == [40.0, "inf"]
    png = next(tmp_path.glob("stub-sweep-*.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    per_rate = json.loads(next(tmp_path.glob("stub-40.0qps-*.json")).read_text())
    assert "ttfts" not in per_rate and "itls" not in per_rate  # not --save-detailed
    assert per_rate["goodput_config"] == {"ttft": 5000.0, "tpot": 1000.0}
    # Each rate got fresh prompts, so the second rate cannot hit the first one's cache.
    prompts = [s.body["prompt"] for s in stub.state.seen]
    assert len(set(prompts)) == len(prompts) == 16


def test_diptych_bench_command(
    stub: StubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    code = diptych_main(
        [
            "bench",
            "--base-url",
            stub.url,
            "--num-prompts",
            "4",
            "--random-input-len",
            "8",
            "--random-output-len",
            "2",
            "--save-result",
            "--save-detailed",
            "--result-filename",
            str(out),
            "--disable-tqdm",
            "--metadata",
            "run=ci",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result" in text and "P99 TTFT (ms):" in text
    doc = json.loads(out.read_text())
    assert doc["run"] == "ci" and len(doc["ttfts"]) == 4 and len(doc["itls"]) == 4
    assert doc["request_rate"] == "inf" and not math.isnan(doc["mean_ttft_ms"])
    assert diptych_main(["bench", "--base-url", stub.url, "--goodput", "itl:3"]) == 2


def test_a_time_scale_sends_sooner_and_reports_simulated_seconds(
    stub: StubServer, builder: PromptBuilder
) -> None:
    """Against a server whose time runs 10x faster, a 20 req/s schedule (in simulated
    seconds) is sent at 200 req/s, and every duration comes back x10."""
    [doc] = run(
        stub, builder, "--num-prompts", "12", "--random-input-len", "8",
        "--random-output-len", "2", "--request-rate", "20", "--seed", "5",
        "--time-scale", "10",
    )  # fmt: skip
    arrivals = sorted(s.arrived for s in stub.state.seen)
    assert arrivals[-1] - arrivals[0] < 0.6 / 10 * 4  # the 0.6 s schedule, 10x sooner
    assert doc["time_scale"] == 10.0 and doc["completed"] == 12
    assert doc["median_ttft_ms"] >= 10 * 50  # the stub's 50 ms wall TTFT, in simulated ms
    assert doc["duration"] >= 12 / 20 * 0.9  # the simulated schedule's length
