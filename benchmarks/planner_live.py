"""The planner on real processes: `diptych serve --planner --engine sim` under
`diptych bench` phases that step the load up and back down.

    python benchmarks/planner_live.py [--phase-seconds 75] [--write-docs]

One `diptych serve` (frontend, 2 prefill + 2 decode workers to start, which the
planner must adopt rather than reset to its minimum; the planner with its local
connector; simulated 70B FP8 workers on H200, 16 streams per decode worker) and three
phases, each a `diptych bench` run:

    prompt-heavy   long prompts, short replies: prefill should grow, decode not
    long-output    short prompts, long replies: decode should grow, prefill not
    idle           no traffic: both pools back to their minimum

Every second it records what the launcher runs (desired, running and ready workers
per pool, from `serve.json`'s control endpoint); near the end of the last phase with
traffic it takes a screenshot of the planner dashboard in headless Chromium (under
load, so every tile has a value); at the end it plots the replicas over time, counts
the requests that failed or were refused (429) in each phase (must be 0, scale-downs
included), checks the pools moved as the phases say and that each pool's first decision
started from the running size, and measures each scale-up: seconds from the planner
raising a pool's target to the launcher counting that many workers ready.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import machine  # noqa: E402
from benchmarks.browser import (  # noqa: E402
    dashboard_filled,
    full_page_screenshot,
    headless_chromium,
    wait_for,
)
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import diptych_server, free_port  # noqa: E402

PROFILE = "H200:Llama-3.1-70B:tp1:float8"
START = (2, 2)  # prefill, decode workers serve starts
IMG = ROOT / "docs" / "img"


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float = 0.0  # requests/s; 0: no traffic
    input_len: int = 0
    output_len: int = 0


PHASES = (
    Phase("prompt-heavy", rate=4.0, input_len=3000, output_len=16),
    Phase("long-output", rate=5.0, input_len=100, output_len=400),
    Phase("idle"),
)


def serve_flags(planner_port: int) -> list[str]:
    return [
        "--engine", "sim", "--profile", PROFILE, "--sim-mean-output-tokens", "0",
        "--max-num-seqs", "16", "--max-num-batched-tokens", "8192",
        "--prefill-workers", str(START[0]), "--decode-workers", str(START[1]),
        "--drain-timeout", "30",
        "--planner", "sla", "--ttft-slo-ms", "2000", "--itl-slo-ms", "100",
        "--planner-interval", "3", "--lookahead", "6", "--predictor", "moving-average",
        "--predictor-window", "2", "--up-cooldown", "6", "--down-cooldown", "12",
        "--idle-timeout", "20", "--min-prefill", "1", "--max-prefill", "4",
        "--min-decode", "1", "--max-decode", "4", "--planner-port", str(planner_port),
    ]  # fmt: skip


class Recorder(threading.Thread):
    """What the launcher runs, once a second, tagged with the phase under way."""

    def __init__(self, control: str) -> None:
        super().__init__(daemon=True)
        self.control = control
        self.phase = "start"
        self.rows: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stopped.wait(1.0):
                try:
                    pools = http.get(self.control + "/pools").json()
                except httpx.HTTPError:
                    continue
                row: dict[str, Any] = {"t": time.monotonic() - self.t0, "phase": self.phase}
                for pool, s in pools.items():
                    for k in ("desired", "running", "ready"):
                        row[f"{pool}_{k}"] = s[k]
                    row[f"{pool}_retiring"] = sum(w["state"] == "retiring" for w in s["workers"])
                self.rows.append(row)


def bench(
    url: str, phase: Phase, seconds: float, out: Path, meanwhile: Callable[[], None] | None = None
) -> dict[str, Any]:
    """One phase's `diptych bench`; `meanwhile` runs while it sends its requests."""
    n = max(1, round(phase.rate * seconds))
    cmd = [
        sys.executable, "-m", "diptych.cli", "bench", "--base-url", url,
        "--dataset-name", "random", "--random-input-len", str(phase.input_len),
        "--random-output-len", str(phase.output_len), "--random-range-ratio", "0.2",
        "--num-prompts", str(n), "--request-rate", str(phase.rate), "--ignore-eos",
        "--temperature", "0", "--disable-tqdm", "--save-result", "--save-detailed",
        "--result-dir", str(out), "--result-filename", f"{phase.name}.json",
        "--request-timeout", "300",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    if meanwhile is not None:
        meanwhile()
    proc.wait()
    doc: dict[str, Any] = json.loads((out / f"{phase.name}.json").read_text())
    return doc


def screenshot(dashboard: str, path: Path) -> None:
    """The whole dashboard once every tile and chart shows something."""
    with headless_chromium(1400, 1500) as driver:
        driver.get(dashboard)
        wait_for(lambda: dashboard_filled(driver), 60, "a value in every tile and chart")
        full_page_screenshot(driver, str(path))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    t = [r["t"] for r in rows]
    colors = {"prefill": "#c2410c", "decode": "#1d4ed8"}
    for pool, c in colors.items():
        ax.step(t, [r[f"{pool}_ready"] for r in rows], where="post", color=c, label=f"{pool} ready")
        ax.step(t, [r[f"{pool}_desired"] for r in rows], where="post", color=c, ls="--",
                alpha=0.6, label=f"{pool} desired")  # fmt: skip
    shade = {"prompt-heavy": "#fde7d9", "long-output": "#dbe4fb", "idle": "#eeeeee"}
    for name, colour in shade.items():
        ts = [r["t"] for r in rows if r["phase"] == name]
        if ts:
            ax.axvspan(min(ts), max(ts), color=colour, zorder=0)
            ax.text((min(ts) + max(ts)) / 2, 4.3, name, ha="center", fontsize=9)
    ax.set_ylim(0, 4.7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("workers")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncol=4)
    ax.set_title("diptych serve --planner --engine sim: replicas per pool under stepped load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def peak(phase: str, key: str) -> int:
        return max((r[key] for r in rows if r["phase"] == phase), default=0)

    first = next(r for r in rows if r["phase"] == PHASES[0].name)
    last = rows[-1]
    return {
        "at the first phase: prefill, decode": (first["prefill_desired"], first["decode_desired"]),
        "prompt-heavy: prefill peak": peak("prompt-heavy", "prefill_desired"),
        "prompt-heavy: decode peak": peak("prompt-heavy", "decode_desired"),
        "long-output: decode peak": peak("long-output", "decode_desired"),
        "long-output: prefill grew": any(
            b["prefill_desired"] > a["prefill_desired"]
            for a, b in itertools.pairwise(rows)
            if b["phase"] == "long-output"
        ),
        "end: prefill, decode": (last["prefill_running"], last["decode_running"]),
    }


def scale_ups(rows: list[dict[str, Any]]) -> list[tuple[str, int, float]]:
    """(pool, target, seconds) for each raise of a pool's target: from the first sample
    showing the new target to the first showing that many workers ready (1 s samples)."""
    out: list[tuple[str, int, float]] = []
    for pool in ("prefill", "decode"):
        for i, (a, b) in enumerate(itertools.pairwise(rows)):
            target = b[f"{pool}_desired"]
            if target <= a[f"{pool}_desired"] or target <= a[f"{pool}_ready"]:
                continue
            ready = next((r for r in rows[i + 1 :] if r[f"{pool}_ready"] >= target), None)
            if ready is not None:
                out.append((pool, target, ready["t"] - b["t"]))
    return out


def refused(doc: dict[str, Any]) -> int:
    """Requests the server turned away with 429 (a subset of `failed`)."""
    return sum(1 for e in doc.get("errors", []) if e and e.startswith("HTTP 429"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--phase-seconds", type=float, default=75.0)
    p.add_argument("--idle-seconds", type=float, default=75.0)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    start = machine.snapshot()
    planner_port = free_port()
    results: dict[str, dict[str, Any]] = {}
    with diptych_server("disaggregated", *serve_flags(planner_port)) as server:
        planner = f"http://127.0.0.1:{planner_port}"
        wait_for(lambda: _ok(planner + "/health"), 120, "the planner")
        manifest = server.manifest()  # written once every child is ready
        rec = Recorder(manifest["control"])
        rec.start()
        out = server.workdir / "results"
        time.sleep(10)  # the planner's baseline ticks at rest
        IMG.mkdir(parents=True, exist_ok=True)
        last_busy = [p.name for p in PHASES if p.rate][-1]

        def shoot() -> None:  # three quarters into the last phase with traffic
            time.sleep(0.75 * args.phase_seconds)
            screenshot(planner + "/dashboard", IMG / "planner-dashboard.png")

        for phase in PHASES:
            rec.phase = phase.name
            print(f"phase {phase.name}", flush=True)
            if phase.rate:
                during = shoot if phase.name == last_busy else None
                results[phase.name] = bench(server.url, phase, args.phase_seconds, out, during)
            else:
                time.sleep(args.idle_seconds)
        state = httpx.get(planner + "/api/state", timeout=10).json()
        rec.stopped.set()
        rec.join()
        log_tail = server.log_tail(60)
    plot(rec.rows, IMG / "planner-live.png")
    v = verdicts(rec.rows)
    failed = {k: d["failed"] for k, d in results.items()}
    decisions = [e for e in state["events"] if e["kind"] == "decision"]
    errors = [e for e in state["events"] if e["kind"] != "decision"]
    ups = scale_ups(rec.rows)
    firsts = {
        pool: next((e["text"] for e in decisions if e["pool"] == pool), "")
        for pool in ("prefill", "decode")
    }
    print(json.dumps({"verdicts": v, "failed": failed, "errors": errors, "scale-ups": ups},
                     indent=1))  # fmt: skip
    print("\n".join(f"{e['pool']}: {e['text']}" for e in decisions))
    ok = (
        v["at the first phase: prefill, decode"] == START
        and all(f"started from {n} " in text for text, n in zip(firsts.values(), START))
        and v["prompt-heavy: prefill peak"] > START[0]
        and v["prompt-heavy: decode peak"] <= START[1]
        and v["long-output: decode peak"] > START[1]
        and not v["long-output: prefill grew"]
        and v["end: prefill, decode"] == (1, 1)
        and not any(failed.values())
    )
    if not ok:
        print("FAILED; the server's last lines:\n" + log_tail)
    if args.write_docs:
        _write_docs(args, start, results, v, decisions, firsts, ups)
    return 0 if ok else 1


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _write_docs(
    args: argparse.Namespace,
    start: dict[str, Any],
    results: dict[str, dict[str, Any]],
    v: dict[str, Any],
    decisions: list[dict[str, Any]],
    firsts: dict[str, str],
    ups: list[tuple[str, int, float]],
) -> None:
    lines = [
        machine.describe(start, machine.snapshot()),
        "",
        "```",
        f"python benchmarks/planner_live.py --phase-seconds {args.phase_seconds:g} "
        f"--idle-seconds {args.idle_seconds:g} --write-docs",
        "```",
        "",
        f"`diptych serve --engine sim --profile {PROFILE} --max-num-seqs 16 --planner sla "
        "--ttft-slo-ms 2000 --itl-slo-ms 100 --planner-interval 3 ...` (real frontend, "
        f"worker and planner processes, the local connector) started with {START[0]} prefill "
        f"+ {START[1]} decode workers (limits 1-4 each, `--max-queued-requests` at its "
        "default), under one `diptych bench` run per phase:",
        "",
        "| phase | load | requests | failed | refused (429) | TTFT p50/p99 ms | "
        "TPOT p50/p99 ms | prefill peak | decode peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    peaks = {
        "prompt-heavy": (v["prompt-heavy: prefill peak"], v["prompt-heavy: decode peak"]),
        "long-output": (
            "grew" if v["long-output: prefill grew"] else "no growth",
            v["long-output: decode peak"],
        ),
    }
    for phase in PHASES:
        d = results.get(phase.name)
        if d is None:
            continue
        pre, dec = peaks[phase.name]
        lines.append(
            f"| {phase.name} | {phase.rate:g} req/s, {phase.input_len} in / "
            f"{phase.output_len} out | {d['completed'] + d['failed']} | {d['failed']} | "
            f"{refused(d)} | "
            f"{d['median_ttft_ms']:.0f}/{d['p99_ttft_ms']:.0f} | "
            f"{d['median_tpot_ms']:.1f}/{d['p99_tpot_ms']:.1f} | {pre} | {dec} |"
        )
    end = v["end: prefill, decode"]
    at_first = v["at the first phase: prefill, decode"]
    secs = sorted(s for _, _, s in ups)
    lines += [
        "",
        f"At the first phase the targets were still {at_first[0]} prefill and {at_first[1]} "
        "decode (the planner's first decisions: "
        + "; ".join(f'{pool} "{text}"' for pool, text in firsts.items())
        + f"). After {args.idle_seconds:g} s without traffic: {end[0]} prefill and {end[1]} "
        f"decode worker running (the minimum). {len(decisions)} decisions, each logged with "
        "its reason (the dashboard's log, the planner's own log); every scale-down drained "
        "its worker (leave discovery, finish what it holds, exit) with no request failing.",
        "",
        "Over the SLA: "
        + (
            "; ".join(
                f"{name}'s TTFT p99 {d['p99_ttft_ms'] / 1e3:.1f} s"
                for name, d in results.items()
                if d["p99_ttft_ms"] > 2000
            )
            or "nothing"
        )
        + " (requests queue while a pool grows to the load that arrived: the planner sizes "
        "for what it forecasts from what it measured, it does not see a phase coming).",
        "",
        f"Scale-ups: {len(ups)}; from the target's raise to that many workers ready "
        + (
            f"{secs[len(secs) // 2]:.0f} s median, {secs[-1]:.0f} s at most (1 s samples of "
            "the launcher's state; a simulated worker's start is the process start, the "
            "tokenizer and registration, what a real worker adds is its weight load: "
            "6.4 s for the whole default-model serve above)."
            if secs
            else "none."
        ),
        "",
        "![replicas per pool over the phases](img/planner-live.png)",
        "",
        "The dashboard late in the long-output phase (headless Chromium): "
        "![planner dashboard](img/planner-dashboard.png)",
    ]
    write_subsection("### The planner on real processes", "\n".join(lines), "## Fleet simulation")


if __name__ == "__main__":
    sys.exit(main())
