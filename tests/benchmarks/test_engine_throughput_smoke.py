"""Smoke run of benchmarks/engine_throughput.py on a tiny workload, so the script can't rot.

Runs it as a subprocess (as a user would), without HF transformers, and checks the raw
JSON is sane and that --write-docs rewrites only the "## Engine" section.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_throughput.py"

DOCS = """# Benchmarks

Intro text.

## Engine

(pending)

## Kernels

Kernel figures stay as they are.
"""

pytestmark = pytest.mark.slow


def test_quick_run_writes_sane_json_and_only_the_engine_section(tmp_path: Path) -> None:
    out, docs = tmp_path / "out.json", tmp_path / "benchmarks.md"
    docs.write_text(DOCS)
    args = [
        "--quick", "--skip-hf", "--batch-sizes", "1,2", "--prompt-len", "16", "--gen-len", "4",
        "--ttft-prompt-len", "32", "--repeats", "1",
        "--json", str(out), "--write-docs", "--docs-path", str(docs),
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    res = json.loads(out.read_text())
    assert res["config"]["dtype"] == "bfloat16"
    assert res["machine"]["torch_threads"] >= 1 and res["machine"]["cpu"]
    limits = res["limits"]
    assert limits["copy_gbps"] > 0 and limits["fp32_gemm_gflops"] > 0
    # the bf16 GEMM is measured only where the CPU has bf16 instructions (0 elsewhere:
    # emulated, it would take minutes; an AVX2-only CPU has none)
    from kernels import cpu_ops

    native_bf16 = cpu_ops.dispatch_report(torch.bfloat16)["gemm"] in ("vnni", "amx", "onednn")
    assert (limits["gemm_gflops"] > 0) == native_bf16, (limits, native_bf16)
    assert res["model"]["weight_bytes"] > 100e6  # SmolLM2-135M in bf16: ~269 MB
    assert [b["batch"] for b in res["batches"]] == [1, 2]
    for b in res["batches"]:
        (run,) = b["diptych"]
        assert run["output_tokens"] == 4 * b["batch"]
        assert run["cached_prompt_tokens"] == 0  # salted runs: no prefix hits
        assert run["total_tok_s"] > 0 and run["decode_tok_s"] > 0
        assert 0 < run["prefill_s"] < run["total_s"]
        assert b["hf"] == []
    assert len(res["ttft_s"]["diptych"]) == 1 and res["ttft_s"]["diptych"][0] > 0
    figures = {f["name"]: f for f in res["efficiency"]}
    assert figures["batch-1 decode bandwidth efficiency"]["value"] > 0
    assert figures["batch-1 speedup vs transformers"]["value"] is None  # HF skipped

    text = docs.read_text()
    head, engine_and_rest = text.split("## Engine\n", 1)
    engine, rest = engine_and_rest.split("## Kernels\n", 1)
    assert head == "# Benchmarks\n\nIntro text.\n\n"
    assert rest == "\nKernel figures stay as they are.\n"
    assert "(pending)" not in engine and "| batch |" in engine
    assert res["command"] in engine
    # The section says how busy the machine was (Linux CPU pressure), when it can tell.
    assert "CPU pressure" in engine
