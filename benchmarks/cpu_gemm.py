"""Decode-batch linears on CPU with bf16 weights, side by side in one run.

    python benchmarks/cpu_gemm.py                # SmolLM2-135M's layer shapes, 30 layers
    python benchmarks/cpu_gemm.py --rows 8,64 --rounds 7
    env $(python -m kernels --env avx2) python benchmarks/cpu_gemm.py   # a forced level

With AVX512-BF16 (the ISA level in use, see kernels/cpu_isa.py): torch's F.linear on
the bf16 weight, oneDNN on a prepacked one, and Diptych's VNNI GEMM
(kernels/csrc/gemm_bf16.cpp). At any other level, where bf16 has no instructions of
its own: torch's F.linear on fp32 copies of the weights (MKL: what runs without bf16
kernels), Diptych's widening GEMV on the bf16 weight (up to 8 rows) and Diptych's
fp32-arithmetic GEMM on the packed bf16 weight (kernels/csrc/gemm_f32acc.cpp).

Weights are random tensors of the model's shapes, one set per layer, so a pass over
the 30 layers streams ~240 MB of bf16 weights that do not fit in the last-level cache,
as a decode step does ("cold"); "hot" repeats one layer's product on one weight. Each
figure is the best of `--rounds` timed passes, the variants alternating round by
round. GFLOP/s = 2 x rows x weight elements / time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# first, also when the root is on PYTHONPATH: benchmarks/kernels.py would shadow `kernels`
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))

from kernels import cpu_isa, cpu_ops  # noqa: E402

# (out, in) of SmolLM2-135M's fused qkv, o, gate_up and down projections
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def best(fn: Callable[[], None], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def plain_pass(layers: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for ws in layers:
            for w, (_, k) in zip(ws, SHAPES):
                torch.nn.functional.linear(xs[k], w)

    return run


def packed_pass(
    layers: list[list[cpu_ops.PackedWeight]], xs: dict[int, torch.Tensor]
) -> Callable[[], None]:
    def run() -> None:
        for ps in layers:
            for pw, (_, k) in zip(ps, SHAPES):
                cpu_ops.packed_linear(xs[k], pw, None)

    return run


def gemv_pass(layers: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        for ws in layers:
            for w, (_, k) in zip(ws, SHAPES):
                cpu_ops.small_m_linear(xs[k], w, None)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="8,64", help="comma-separated batch sizes")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if not cpu_ops.cpu_ops_available():
        sys.exit("needs the C++ CPU ops")
    torch.manual_seed(0)
    layers = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(args.layers)]
    ours = [[cpu_ops.pack_linear_weight(w) for w in ws] for ws in layers]
    vnni = cpu_ops._vnni_available()
    if vnni:
        onednn = [
            [cpu_ops.PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 64), "onednn", n)
             for w, (n, _) in zip(ws, SHAPES)]
            for ws in layers
        ]  # fmt: skip
        names = ["torch F.linear", "oneDNN prepacked", "Diptych packed GEMM"]
    else:
        fp32 = [[w.float() for w in ws] for ws in layers]
        names = ["torch F.linear, fp32 weights", "Diptych GEMV", "Diptych f32acc GEMM"]
    weights = sum(n * k for n, k in SHAPES)
    isa = cpu_isa.probe()
    print(
        f"ISA level {isa.level} (CPU {isa.model}, native {isa.native}); ATen "
        f"{cpu_isa.aten_capability()}; {torch.get_num_threads()} threads; {args.layers} layers "
        f"x {SHAPES}; best of {args.rounds}; GFLOP/s"
    )
    print("| rows | weights | " + " | ".join(names) + " |")
    print("|---:|---|" + "---:|" * len(names))
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES}
        xs32 = {k: x.float() for k, x in xs.items()}

        for label, hot in (("cold", False), ("hot", True)):
            pick = (lambda t: t[:1] * args.layers) if hot else (lambda t: t)
            if vnni:
                variants: list[Callable[[], None] | None] = [
                    plain_pass(pick(layers), xs),
                    packed_pass(pick(onednn), xs),
                    packed_pass(pick(ours), xs),
                ]
            else:
                variants = [
                    plain_pass(pick(fp32), xs32),
                    gemv_pass(pick(layers), xs) if rows <= cpu_ops.SMALL_M_MAX else None,
                    packed_pass(pick(ours), xs),
                ]
            times = [float("inf")] * len(variants)
            for _ in range(args.rounds):
                for i, fn in enumerate(variants):
                    if fn is not None:
                        times[i] = min(times[i], best(fn, 1))
            flops = 2 * rows * weights * args.layers
            cells = " | ".join(
                "n/a" if t == float("inf") else f"{flops / t / 1e9:.0f}" for t in times
            )
            print(f"| {rows} | {label} | {cells} |")


if __name__ == "__main__":
    main()
