"""The Ray connector against a real local Ray cluster (ray_scenario.py), in a private
network namespace: Ray's processes listen on every interface, and tests talk only
to loopback. Needs root (CAP_SYS_ADMIN) for the namespace and `ray` installed; it
fails, never skips, without them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_workers_as_ray_actors_scale_up_down_and_are_adopted(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed for the private namespace"
    script = (
        "ip link set lo up 2>/dev/null || python -c 'from transfer.testing import "
        'bring_loopback_up as b; b()\'; exec "$0" "$@"'
    )
    cmd = [unshare, "-n", "sh", "-c", script, sys.executable,
           str(ROOT / "tests/planner/ray_scenario.py"), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(lines[-1].removeprefix("RESULT "))
    assert seen["up"] == {"prefill": ["prefill-0"], "decode": ["decode-0", "decode-1"]}
    assert seen["after_down"]["decode"] == ["decode-0"]  # the newest went
    assert seen["draining_left"] == []  # its actor stopped and was killed
    assert seen["adopted"] == {"decode": ["diptych-decode-0"], "prefill": ["diptych-prefill-0"]}
    assert seen["named_actors"] == ["diptych-decode-0", "diptych-prefill-0"]  # none added
    assert seen["draining_at_zero"] == []
