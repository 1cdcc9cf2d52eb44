"""A prompt's attention on CPU: torch's SDPA over its fresh K/V (causal, the flash
kernel for CPU) against the batch-invariant kernel over the paged cache, every token
one row (`cpu_ops.det_attention`), which the default mode runs for prompts where
`cpu_ops.det_attention_for_prompts` says so.

    python -m benchmarks.prompt_attention                # the table
    python -m benchmarks.prompt_attention --docs         # and the docs/benchmarks.md section
    env $(python -m kernels --env avx2) python -m benchmarks.prompt_attention

One causal prompt of each length, random K/V on shuffled 16-token blocks, the two
kernels taking turns; each figure is the median of `--repeats` rounds. The ISA level is
the process's (forced with `python -m kernels --env LEVEL`).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.docs_section import write_subsection
from benchmarks.machine import commit, cpu_isa, cpu_name
from benchmarks.timing import median_ms
from kernels import cpu_isa as isa
from kernels import cpu_ops
from kernels.paged import PagedBatch, PagedLayer

BLOCK = 16
# (query heads, KV heads, head dim): SmolLM2-135M's, Llama-3-8B's
SHAPES = ((9, 3, 64), (32, 8, 128))


def case(
    heads: int, kv_heads: int, d: int, n: int, dtype: torch.dtype, repeats: int
) -> tuple[float, float, float]:
    """(rows ms, SDPA ms, max |difference|) for one prompt of `n` tokens."""
    g = torch.Generator().manual_seed(n)
    nb = -(-n // BLOCK)
    blocks = nb + 4
    k_cache = torch.randn(blocks, BLOCK, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, BLOCK, kv_heads, d, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)[:nb].int()
    q = torch.randn(n, heads, d, generator=g).to(dtype)
    k = k_cache[table.long()].reshape(-1, kv_heads, d)[:n]
    v = v_cache[table.long()].reshape(-1, kv_heads, d)[:n]
    layer = PagedLayer(k_cache, v_cache, d**-0.5)
    lens = torch.arange(1, n + 1, dtype=torch.int32)
    batch = PagedBatch(lens, table[None].contiguous(), max_seq_len=n)
    row_seq = torch.zeros(n, dtype=torch.int32)
    out = torch.empty_like(q)

    def rows() -> None:
        cpu_ops.det_attention(q, layer, batch, row_seq, out)

    def sdpa() -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=d**-0.5, enable_gqa=kv_heads != heads,
        )  # fmt: skip
        return o[0].transpose(0, 1)

    rows()
    diff = (out.float() - sdpa().float()).abs().max().item()
    ms = median_ms({"rows": rows, "sdpa": sdpa}, repeats, calls=max(2, 2000 // n))
    return ms["rows"], ms["sdpa"], diff


def report(args: argparse.Namespace) -> str:
    probe = isa.probe()
    level = probe.level + (f" (forced; the CPU's own is {probe.native})" if probe.forced else "")
    dtype = getattr(torch, args.dtype)
    lines = [
        f"Command: `python -m benchmarks.prompt_attention{' --docs' if args.docs else ''}"
        f"{'' if args.dtype == 'bfloat16' else f' --dtype {args.dtype}'}`"
        f"{'' if not probe.forced else f' under `python -m kernels --env {probe.level}`'}. "
        f"{cpu_name()} ({cpu_isa()}), ISA level {level}, {torch.get_num_threads()} threads, "
        f"{args.dtype}, commit {commit()}, {time.strftime('%Y-%m-%d')}. Median of "
        f"{args.repeats} rounds. The default mode takes the rows here: "
        f"{'yes' if cpu_ops.det_attention_for_prompts(dtype, dtype, 64) else 'no'}.",
        "",
        "| heads / KV heads / dim | prompt tokens | rows ms | SDPA ms | rows / SDPA | max diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for heads, kv_heads, d in SHAPES:
        for n in args.lengths:
            a, b, diff = case(heads, kv_heads, d, n, dtype, args.repeats)
            lines.append(f"| {heads} / {kv_heads} / {d} | {n} | {a:.2f} | {b:.2f} | "
                         f"{a / b:.2f} | {diff:.2g} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 4096])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section")
    args = p.parse_args(argv)
    if not cpu_ops.cpu_ops_available():
        print("the C++ CPU ops did not build")
        return 2
    table = report(args)
    print(table)
    if args.docs:
        heading = f"### Prompt attention on CPU at ISA level {isa.probe().level}, {args.dtype}"
        write_subsection(heading, table, section="## Engine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
