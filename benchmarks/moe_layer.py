"""One mixture-of-experts MLP layer on this CPU: the engine's grouped path against a
Python loop over the active experts and against transformers' own MoE block, at a few
token counts, on the same weights.

The layer is Qwen3-30B-A3B's (hidden 2048, 128 experts of 768, the top 8
renormalized) in bf16, random weights, about 1.2 GB. Three ways compute it:

- grouped: `kernels.moe` as the engine runs it (`route`, then `ops.fused_moe`: the
  pairs sorted by expert, each active expert's rows through our C++ GEMV);
- loop: the same routing, then per active expert three linears on its tokens (the
  shape of the usual eager MoE);
- transformers: `Qwen3MoeSparseMoeBlock.forward` with its eager experts (a loop over
  the active experts) and with its `grouped_mm` experts implementation (its fastest
  on CPU: torch's grouped GEMM, as ours);
- and the same experts kept FP8 (e4m3, a scale per row: `--quantization fp8`) through
  our grouped C++ FP8 kernel, which reads half the bytes.

Each is timed as the median of `--repeat` calls after one warm-up, the four taking
turns, with the outputs checked against each other.

    python -m benchmarks.moe_layer                # prints the table
    python -m benchmarks.moe_layer --docs         # and writes the docs/benchmarks.md section
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.docs_section import write_subsection
from benchmarks.machine import commit, cpu_isa, cpu_name
from benchmarks.timing import median_ms
from kernels import moe, ops
from kernels.quant import cat_rows, quantize_fp8

HIDDEN, WIDTH, EXPERTS, TOP_K = 2048, 768, 128, 8
TOKENS = (1, 8, 64)


def _hf_block(dtype: torch.dtype, experts: str) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, experts_implementation=experts,
    )  # fmt: skip
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def _stacked(block: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router [E, H], w13 [E, 2I, H], w2 [E, H, I]) from transformers' block."""
    experts = block.experts
    return block.gate.weight, experts.gate_up_proj.data, experts.down_proj.data


def _loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
          ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = F.linear(x[tok], w13[e])
        y = F.linear(F.silu(h[:, :WIDTH]) * h[:, WIDTH:], w2[e])
        out.index_add_(0, tok, y.float() * weights[tok, slot, None])
    return out.to(x.dtype)


def measure(repeat: int, dtype: torch.dtype) -> list[dict[str, float]]:
    block = _hf_block(dtype, "eager")
    tuned = _hf_block(dtype, "grouped_mm")  # the same seed: the same weights
    router, w13, w2 = _stacked(block)
    assert w13.shape == (EXPERTS, 2 * WIDTH, HIDDEN), w13.shape
    f13 = moe.Fp8Experts.stack(
        [cat_rows([quantize_fp8(w[:WIDTH]), quantize_fp8(w[WIDTH:])]) for w in w13]
    )
    f2 = moe.Fp8Experts.stack([quantize_fp8(w) for w in w2])
    rows = []
    with torch.inference_mode():
        for t in TOKENS:
            x = torch.randn(t, HIDDEN, generator=torch.Generator().manual_seed(t)).to(dtype)

            def grouped(x: torch.Tensor = x) -> torch.Tensor:
                w, ids = moe.route(F.linear(x, router), TOP_K, True)
                return ops.fused_moe(x, w13, w2, w, ids)

            def loop(x: torch.Tensor = x) -> torch.Tensor:
                w, ids = moe.route(F.linear(x, router), TOP_K, True)
                return _loop(x, w13, w2, w, ids)

            def hf(x: torch.Tensor = x, block: torch.nn.Module = block) -> torch.Tensor:
                out = block(x[None])
                return (out[0] if isinstance(out, tuple) else out)[0]

            def hf_grouped(x: torch.Tensor = x) -> torch.Tensor:
                return hf(x, tuned)

            def fp8(x: torch.Tensor = x) -> torch.Tensor:
                w, ids = moe.route(F.linear(x, router), TOP_K, True)
                return ops.fused_moe(x, f13, f2, w, ids)

            a, c = grouped(), hf()
            scale = float(c.float().abs().max())
            for other in (loop(), hf_grouped()):
                assert float((a.float() - other.float()).abs().max()) < 0.05 * scale
            # e4m3 keeps 3 mantissa bits: its output is near, not equal
            assert float((fp8().float() - a.float()).abs().max()) < 0.2 * scale
            fns = {"grouped_ms": grouped, "loop_ms": loop, "transformers_ms": hf,
                   "transformers_grouped_ms": hf_grouped, "fp8_ms": fp8}  # fmt: skip
            rows.append({"tokens": t, **median_ms(fns, repeat)})
    return rows


def table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| tokens | grouped (ours) | loop over experts | transformers eager | "
        "transformers grouped_mm | FP8 experts, grouped C++ (ours) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']:.0f} | {r['grouped_ms']:.1f} ms | {r['loop_ms']:.1f} ms | "
            f"{r['transformers_ms']:.1f} ms | {r['transformers_grouped_ms']:.1f} ms | "
            f"{r['fp8_ms']:.1f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section")
    args = ap.parse_args()
    rows = measure(args.repeat, torch.bfloat16)
    text = table(rows)
    print(text)
    if args.docs:
        body = (
            f"One Qwen3-30B-A3B MoE layer (hidden {HIDDEN}, {EXPERTS} experts of {WIDTH}, "
            f"top {TOP_K} renormalized), bf16 random weights, {torch.get_num_threads()} "
            f"threads on {cpu_name()} ({cpu_isa()}), commit {commit()}; median of "
            f"{args.repeat} calls each after a warm-up, taken in turns, outputs checked against "
            "each other.\n\n"
            f"{text}\n\n"
            "grouped: `kernels/moe.py` as the engine runs it (the pairs sorted by expert, "
            "each active expert's rows through our C++ GEMV against its weights read in "
            "place: `grouped_linear`, kernels/csrc/gemv_cpu.cpp); loop: the same "
            "routing, then three linears per active expert; transformers: "
            "`Qwen3MoeSparseMoeBlock` with its eager experts and with "
            "`experts_implementation=\"grouped_mm\"`; FP8 experts: the same weights "
            "quantized per row to e4m3 (`--quantization fp8`, 0.6 GB), through "
            "`fp8_grouped_linear` (kernels/csrc/fp8_linear_cpu.cpp). At 8 and 64 tokens a "
            "layer reads most of its 1.2 GB of bf16 experts. torch's grouped GEMM (the "
            "transformers grouped_mm column) runs one or a few rows an expert through a "
            "GEMM that leaves memory bandwidth unused; the GEMV streams the weights, and "
            "FP8 reads half the bytes again. (The Triton grouped GEMM, "
            "kernels/triton/fused_moe.py, runs on GPUs only.)\n\n"
            "    python -m benchmarks.moe_layer --docs\n"
        )
        write_subsection("### Mixture-of-experts layer", body, section="## Engine")
        print("wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
