"""scripts/gpu_check.py keeps working between leases of a GPU: its smoke mode runs the
parity and decode parts on the CPU (the same code, the device aside) and writes the JSON
a lent machine's run would bring back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_its_parts_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    run = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--smoke", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["parity"]["pass"] and all(doc["parity"]["tokens_equal"])
    assert doc["decode"]["ok"] and doc["decode"]["default_batch4"]["decode_steps"] > 0
    assert "kernels" not in doc and "attention_bandwidth" not in doc  # GPU-only parts
    assert doc["tier_copy"]["ok"] and doc["tier_copy"]["roundtrip_equal"]
