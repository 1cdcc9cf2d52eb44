"""The Grafana dashboard is generated (deploy/grafana/build_dashboard.py) and the
committed JSON is what the generator writes; every query names only metrics the code
defines (test_chart_matches_code.py scrapes them from a live `diptych serve`)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.deploy.chart import ROOT

GRAFANA = ROOT / "deploy" / "grafana"


def test_the_committed_dashboard_is_what_the_generator_writes() -> None:
    out = subprocess.run(
        [sys.executable, str(GRAFANA / "build_dashboard.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dashboard_covers_every_part_of_the_fleet() -> None:
    doc = json.loads((GRAFANA / "diptych-dashboard.json").read_text())
    rows = [p["title"] for p in doc["panels"] if p["type"] == "row"]
    assert rows == [
        "Frontend", "KV-aware routing", "Prefill pool", "Decode pool", "KV transfer", "Planner",
    ], rows  # fmt: skip
    exprs = " ".join(t["expr"] for p in doc["panels"] for t in p.get("targets", []))
    for needed in ("time_to_first_token", "inter_token_latency", "request_duration",
                   "prefill_queue_depth", "kv_used_blocks", "prefix_hit_rate",
                   "remote_prefills", "sent_bytes", "write_seconds",
                   "transfer_failures_total", "desired_replicas", "ready_replicas",
                   "decisions_total", "router_decisions_total",
                   "router_actual_cached_tokens"):  # fmt: skip
        assert needed in exprs, needed
    assert doc["uid"] == "diptych-overview"
    assert {v["name"] for v in doc["templating"]["list"]} >= {"datasource", "job"}
