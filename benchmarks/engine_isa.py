#!/usr/bin/env python
"""The engine benchmark on every CPU ISA level this machine can run, in one session.

    python benchmarks/engine_isa.py                       # every level, default workload
    python benchmarks/engine_isa.py --levels avx2,generic --write-docs
    python benchmarks/engine_isa.py --quick               # smoke run

Each level runs `benchmarks/engine_throughput.py` in its own process: the CPU's own
level natively, every lower one forced from the first instruction
(`kernels.cpu_isa.forced_environment`: DIPTYCH_CPU_ISA plus the ATen, oneDNN and MKL
limits, read once per process). HF transformers runs beside Diptych in each process,
restricted the same way, in the dtype it is fastest in at that level: bfloat16 where
the CPU has bf16 instructions, float32 elsewhere (its bf16 there is emulated). The
FLOP target is measured against the GEMM of the dtype the linears compute in (fp32
for bf16 weights widened in registers). `--write-docs` rewrites the
"## Engine on each CPU ISA level" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# first, also when the root is on PYTHONPATH: benchmarks/kernels.py would shadow `kernels`
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import engine_throughput as et  # noqa: E402
from benchmarks.docs_section import write_section  # noqa: E402
from kernels import cpu_isa  # noqa: E402

HEADING = "## Engine on each CPU ISA level"


def levels_of(native: str) -> list[str]:
    """The CPU's own level first, then every lower one."""
    return list(reversed(cpu_isa.LEVELS[: cpu_isa.LEVELS.index(native) + 1]))


def hf_dtype(level: str) -> str:
    return "bfloat16" if level == "avx512_bf16" else "float32"


def run_level(level: str, native: str, passthrough: list[str]) -> dict[str, Any]:
    env = dict(os.environ)
    for key in cpu_isa.FORCING_VARIABLES:
        env.pop(key, None)
    if level != native:
        env.update(cpu_isa.forced_environment(level))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "engine.json"
        cmd = [
            sys.executable, str(REPO_ROOT / "benchmarks" / "engine_throughput.py"),
            "--hf-dtype", hf_dtype(level), "--json", str(out), *passthrough,
        ]  # fmt: skip
        print(f"== {level}{'' if level == native else ' (forced)'}: {shlex.join(cmd[1:])}")
        subprocess.run(cmd, env=env, check=True)
        res: dict[str, Any] = json.loads(out.read_text())
    res["isa_level"] = level
    res["isa_forced"] = level != native
    return res


def summary(results: list[dict[str, Any]]) -> str:
    """One row per level: throughput beside HF at each batch size, and the targets."""
    sizes = results[0]["config"]["batch_sizes"]
    head = ["level", "linear / attention", *[f"batch {b}: tok/s vs HF" for b in sizes]]
    head += ["batch-1 bandwidth", "large-batch FLOP", "batch-1 speedup"]
    rows = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for res in results:
        k = res["config"].get("kernels", {})
        cells = [
            res["isa_level"] + (" (forced)" if res["isa_forced"] else " (native)"),
            f"{k.get('gemm', '?')} / {k.get('attention', '?')}",
        ]
        for b in res["batches"]:
            d, h = et._median_of(b["diptych"]), et._median_of(b["hf"])
            assert d is not None
            if h is None:
                cells.append(f"{d['total_tok_s']:.1f}")
            else:
                ratio = d["total_tok_s"] / h["total_tok_s"]
                cells.append(f"{d['total_tok_s']:.1f} vs {h['total_tok_s']:.1f} ({ratio:.2f}x)")
        for f in res["efficiency"]:
            cells.append(f"{et._fmt_fig(f['value'], f['unit'])} {et._verdict(f)}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def docs_body(results: list[dict[str, Any]], command: str, note: str = "") -> str:
    info = results[0]["machine"]
    k0 = results[0]["config"].get("kernels", {})
    parts = [
        f"Measured on {info['cpu']}, {info['logical_cpus']} cores, torch {info['torch']} "
        f"({info['torch_threads']} threads), Python {info['python']}; CPU features: "
        f"{k0.get('features', 'n/a')}. Code: commit {info.get('git', {}).get('commit', '?')}. "
        "One session, the levels one after another, each in its own process: the CPU's "
        "own level natively, the lower ones forced (DIPTYCH_CPU_ISA with the ATen, oneDNN "
        "and MKL limits set before Python starts). A forced level runs exactly the "
        "instructions of its level in our kernels and ATen's, while MKL, which runs HF's "
        "fp32 matmuls, may not honour its limit on a non-Intel CPU (check its fp32 GEMM "
        "figure per level below). "
        "HF transformers runs in bfloat16 where the CPU has bf16 instructions and in "
        "float32 elsewhere (its fastest dtype there). Diptych runs `--dtype auto`'s "
        "choice, bfloat16 weights everywhere." + (f" {note}" if note else ""),
        "",
        "```",
        command,
        "```",
        "",
        summary(results),
        "",
        "Columns: tok/s over the whole run (prefill included), median of repeated runs; "
        "the three targets as in the Engine section (batch-1 decode bandwidth against "
        "copy bandwidth, largest-batch decode FLOP/s against the GEMM FLOP/s of the "
        "dtype the linears compute in, batch-1 speedup over HF).",
    ]
    for res in results:
        lim = res["limits"]
        forced = "forced" if res["isa_forced"] else "native"
        parts += [
            "",
            f"### {res['isa_level']} ({forced})",
            "",
            f"Kernels: {_kernels_line(res['config'].get('kernels', {}))}. Machine during "
            f"this level: copy {lim['copy_gbps']:.1f} GB/s, fp32 GEMM "
            f"{lim.get('fp32_gemm_gflops', 0.0):.0f} GFLOP/s; load average "
            f"{(res['machine'].get('loadavg_start') or ['?'])[0]} at its start.",
            "",
            et.tables(res),
        ]
    return "\n".join(parts)


def _kernels_line(k: dict[str, str]) -> str:
    keys = ("isa_level", "build", "aten", "dtype", "gemv", "gemm", "attention", "elementwise")
    return ", ".join(f"{key} {k[key]}" for key in keys if key in k)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default=None, help="comma-separated (default: every level)")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--docs-path", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--note", default="", help="a paragraph to add to the docs section")
    ap.add_argument("--json", type=Path, default=None, help="write every level's results here")
    args, passthrough = ap.parse_known_args(argv)
    native = cpu_isa.probe().native
    levels = args.levels.split(",") if args.levels else levels_of(native)
    for level in levels:
        if level not in cpu_isa.LEVELS or cpu_isa.LEVELS.index(level) > cpu_isa.LEVELS.index(
            native
        ):
            ap.error(f"{level!r} is not a level this CPU can run ({', '.join(levels_of(native))})")
    results = [run_level(level, native, passthrough) for level in levels]
    print()
    print(summary(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.write_docs:
        command = shlex.join(["python", "benchmarks/engine_isa.py", *argv])
        body = docs_body(results, command, args.note)
        write_section(HEADING, body, args.docs_path, after="## Engine")
        print(f"rewrote {HEADING!r} in {args.docs_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
