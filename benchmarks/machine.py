"""What machine a serving benchmark ran on, and how busy it was (for the docs)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The CPU's vector extensions that decide which kernels run (from /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
                return " + ".join(have) or "no AVX2"
    except OSError:
        pass
    return platform.machine()


def cpu_pressure() -> float | None:
    """Share of the last 60 s some task waited for a CPU (Linux PSI), in percent."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(first.split("avg60=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        return None


def load() -> dict[str, Any]:
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "cpu_pressure_60s": cpu_pressure()}


def commit(tree: Path = ROOT) -> str:
    """`tree`'s short commit id (this checkout's by default), noting uncommitted changes."""
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=tree
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], capture_output=True, text=True, cwd=tree
    ).stdout.strip()
    return out.stdout.strip() + (" + uncommitted changes" if dirty else "")


def snapshot() -> dict[str, Any]:
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(),
        "isa": cpu_isa(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit(),
        **load(),
    }


def describe(start: dict[str, Any], end: dict[str, Any]) -> str:
    """One sentence for the docs: machine, date, commit and load during the run."""

    def busy(s: dict[str, Any]) -> str:
        p = s.get("cpu_pressure_60s")
        return "n/a" if p is None else f"{p:.0f} %"

    return (
        f"Measured {start['date']} on {start['cpu']} ({start.get('isa', '?')}), "
        f"{start['cpus']} CPUs, Python "
        f"{start['python']}, code at {start['commit']}. The machine was shared with other "
        f"jobs: load average {start['loadavg'][0]} at the start and {end['loadavg'][0]} at "
        f"the end; tasks waited for a CPU {busy(start)} / {busy(end)} of the time "
        "(Linux CPU pressure, last 60 s, at start / end)."
    )
