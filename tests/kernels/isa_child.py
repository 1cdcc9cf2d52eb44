"""Run in a fresh process (forced to an ISA level, or on an emulated CPU): report which
path every CPU op takes here and check each against its torch reference; print JSON.

    python -m tests.kernels.isa_child [--engine]

`--engine` also generates two greedy tokens with the default model at `dtype auto`.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import torch

import kernels  # noqa: F401  (probes the CPU before any torch op)
from kernels import cpu_isa, cpu_ops, ops, reference
from kernels.paged import PagedBatch, PagedLayer


def _linear_errors(g: torch.Generator) -> tuple[str, str, dict[int, float]]:
    """Pack kinds (a SmolLM2 shape; one VNNI cannot take) and the relative error of
    `ops.linear`'s fp32 sums on the weight packed as the head packs it, at 1, 8 and 64
    rows, against fp32."""
    w = torch.randn(960, 576, generator=g).bfloat16()
    if not cpu_ops.weight_prepack_available(torch.bfloat16):
        packed = odd = None
    else:
        packed = cpu_ops.pack_linear_weight(w)
        odd = cpu_ops.pack_linear_weight(torch.randn(40, 64, generator=g).bfloat16())
    head = packed and cpu_ops.pack_linear_weight(w, fp32_sums=True)  # how the head packs
    errs = {}
    for m in (1, 8, 64):
        x = torch.randn(m, 576, generator=g).bfloat16()
        got = ops.linear(x, w, None, head, fp32_out=True)
        ref = x.float() @ w.float().T
        errs[m] = float((got - ref).abs().max() / ref.abs().max())
    return (packed.kind if packed else "none"), (odd.kind if odd else "none"), errs


def _attention_errors(g: torch.Generator) -> dict[str, float]:
    """Decode attention (GQA 3, head dim 64, three sequences) as dispatched, against
    the reference."""
    errs = {}
    for dtype in (torch.bfloat16, torch.float32):
        pool = torch.randn(12, 2, 16, 2, 64, generator=g).to(dtype)
        q = torch.randn(3, 6, 64, generator=g).to(dtype)
        table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=torch.int32)
        lens = torch.tensor([40, 1, 33], dtype=torch.int32)
        args = (q, PagedLayer(pool[:, 0], pool[:, 1], 0.125), PagedBatch(lens, table))
        got = ops.unified_attention(*args)
        ref = reference.paged_decode_attention(*args)
        errs[str(dtype).removeprefix("torch.")] = float((got.float() - ref.float()).abs().max())
    return errs


def main(argv: list[str]) -> dict[str, Any]:
    isa, build = cpu_isa.probe(), cpu_ops.cpu_build()
    g = torch.Generator().manual_seed(0)
    pack, pack_odd, linear_err = _linear_errors(g)
    out: dict[str, Any] = {
        "level": isa.level,
        "native": isa.native,
        "model": isa.model,
        "build": build.level,
        "build_path": build.path,
        "build_info": build.info,
        "build_failures": list(build.failures),
        "aten": cpu_isa.aten_capability(),
        "onednn_bf16": cpu_ops.onednn_bf16_available(),
        "amx": cpu_ops.amx_available(),
        "auto_dtype": str(cpu_ops.auto_dtype()).removeprefix("torch."),
        "report": cpu_ops.dispatch_report(torch.bfloat16, True, (3, 64)),
        "pack": pack,
        "pack_odd": pack_odd,
        "linear_err": linear_err,
        "attention_err": _attention_errors(g),
    }
    if "--engine" in argv:
        from engine import LLM, SamplingParams

        # one thread, two tokens (the prompt's GEMM step, one GEMV step): under QEMU each
        # step costs a minute or more of a core, which the rest of the suite shares,
        # and a second thread adds a fifth to it
        llm = LLM(max_num_seqs=4, kv_cache_memory_bytes=64 << 20, threads=1)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        res = llm.generate(["The capital of France is"], params)[0]
        out["engine"] = {"text": res.text, "paths": llm.engine.runner.kernel_paths()}
    return out


if __name__ == "__main__":
    # the build's lines (which level, how long, from where) go to stderr, where a
    # failing test shows them
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(json.dumps(main(sys.argv[1:])))
