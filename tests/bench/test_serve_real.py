"""A small real run: `diptych bench` against `diptych serve` (disaggregated, shm).

Prompts of 48 tokens with the remote-prefill threshold at 32 go through the prefill
worker, so this exercises the whole request path; the server's own usage counts
must equal the workload's exact lengths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diptych.cli import main as diptych_main
from tests.e2e.serving import Server


@pytest.mark.slow
def test_bench_against_diptych_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = Server(
        tmp_path / "serve", "--kv-cache-memory", "0.25", "--min-remote-prefill-tokens", "32"
    )
    try:
        out = tmp_path / "result.json"
        code = diptych_main(
            [
                "bench",
                "--base-url",
                server.url,
                "--num-prompts",
                "8",
                "--random-input-len",
                "48",
                "--random-output-len",
                "6",
                "--max-concurrency",
                "4",
                "--temperature",
                "0",
                "--goodput",
                "ttft:120000",
                "tpot:60000",
                "--num-warmups",
                "1",
                "--save-result",
                "--result-filename",
                str(out),
                "--disable-tqdm",
            ]
        )
        decode = server.metrics("decode-0")
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
    assert code == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (8, 0)
    assert doc["total_input_tokens"] == 8 * 48  # the server's usage: lengths are exact
    assert doc["total_output_tokens"] == 8 * 6  # ignore_eos, on by default for random
    assert doc["request_goodput"] == pytest.approx(doc["request_throughput"])
    assert 0 < doc["median_ttft_ms"] < doc["median_e2el_ms"]
    assert doc["mean_tpot_ms"] > 0 and doc["mean_itl_ms"] > 0
    assert 1 <= doc["max_concurrent_requests"] <= 4
    assert doc["model_id"] == "SmolLM2-135M-Instruct"
    remote = decode.get('diptych_worker_requests_total{prefill="remote"}', 0)
    assert remote >= 8, "the prompts were prefilled by the prefill worker"
