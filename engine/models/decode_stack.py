"""A decode step's decoder layers in one C++ call (`kernels/csrc/decode_stack_cpu.cpp`).

At batch 1 the layer loop of `engine.models.llama` runs ~11 ops a layer, 330 a step
for a 30-layer model, each a few tens of microseconds of kernel plus the interpreter,
`kernels.ops`'s path checks and the dispatcher. `DecodeStack` hands the whole loop to
one C++ op that calls the same kernels, so the output is bit-identical and only the
per-op overhead goes.

It is built once, after the weights are loaded (`ModelRunner`), when the model can
take it: on CPU with the C++ ops, the torch attention backend, no q/k norm (Qwen3)
and a head size the C++ decode kernel takes. Linears kept quantized (`--quantization`)
run the integer dot-product kernel; dense ones (a dense model, or a GGUF's linears of
a type dequantized at load, such as Q5_1 or Q5_K) what `kernels.ops.linear` picks:
the small-M GEMV up to its rows, torch's linear above. A step uses the op when all its
rows are decode rows (decodes and speculative verify rows,
`TorchAttentionMetadata.prefills` empty) and no more than `max_rows`: 64, or the
GEMV's 1-3 where a dense linear has a packed copy (bf16 with `cpu_weight_prepack`),
whose GEMM the op does not reproduce; in a row-invariant step
(`kernels.ops.row_invariant`: one that verifies drafts) every dense linear takes the
GEMV, so up to its 8 rows too. Anything else runs the layer loop.
`DIPTYCH_DECODE_STACK=0` turns it off (for A/B measurements).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.attention.torch_backend import TorchAttention, TorchAttentionMetadata
from engine.models.layers import Linear
from engine.models.llama import LlamaDecoderLayer
from kernels import cpu_ops, ops


@dataclass
class DecodeStack:
    """The flat argument lists of `diptych_cpu::decode_layers` for one model."""

    weights: list[torch.Tensor | None]
    dims: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    window: int
    max_rows: int  # the most rows a step may have for every linear's kernel to match
    steps: int = field(default=0, compare=False)  # steps it ran (tests, metrics)

    def run(
        self, x: torch.Tensor, kv_caches: list[torch.Tensor], meta: object, cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """(hidden, residual) after the last layer, or None when this step is not one
        the op takes (the caller runs the layer loop)."""
        if not isinstance(meta, TorchAttentionMetadata) or meta.prefills or meta.decodes is None:
            return None
        t = x.shape[0]
        invariant = ops.row_invariant_rows()  # every dense linear then takes the GEMV
        if meta.num_decodes != t or t > max(self.max_rows, invariant):
            return None
        if meta.slots.dtype != torch.int64:
            return None
        d = meta.decodes
        h, residual = torch.ops.diptych_cpu.decode_layers.default(
            x, self.weights, self.dims, kv_caches, d.block_table, d.seq_lens, meta.slots,
            cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale,
            self.window, invariant,
        )  # fmt: skip
        self.steps += 1
        return h, residual


def _linear(lin: Linear, weights: list[torch.Tensor | None], dims: list[int]) -> int:
    """Append `lin`'s entries; return the most rows it takes (0: it cannot run)."""
    if lin.quant:
        dims.append(len(lin.quant))
        for q in lin.quant:
            weights += [q.codes, q.scales, q.mins]
            dims += [q.group, q.shape[0]]
        return ops.QUANT_DOT_MAX_ROWS
    # dense, as ops.linear runs it: the small-M GEMV up to its rows, then torch's
    # linear; a packed copy's GEMM is not reproduced here, so packed stops at the GEMV
    w = lin.weight
    if w.dim() != 2 or not w.is_contiguous() or lin.in_features % 16:
        return 0
    gemv = cpu_ops.SMALL_M_BEST if lin.packed is None else lin.packed.gemv_rows
    weights += [w.data, None, None]
    dims += [1, 0, gemv]
    return ops.QUANT_DOT_MAX_ROWS if lin.packed is None else gemv


def build_decode_stack(
    layers: Sequence[LlamaDecoderLayer], backend: object, device: torch.device
) -> DecodeStack | None:
    """The stack for these decoder layers, or None where the op cannot run them."""
    if os.environ.get("DIPTYCH_DECODE_STACK", "1") == "0" or device.type != "cpu":
        return None
    if not isinstance(backend, TorchAttention) or backend.kernels.selection.backend != "auto":
        return None
    if not cpu_ops.cpu_ops_available() or backend.head_dim % 16 or not len(layers):
        return None
    weights: list[torch.Tensor | None] = []
    dims: list[int] = []
    eps = float(layers[0].input_layernorm.eps)
    rows: list[int] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qk_norm:
            return None
        if layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps:
            return None
        weights.append(layer.input_layernorm.weight.data)
        weights.append(None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data)
        rows.append(_linear(attn.qkv_proj, weights, dims))
        rows.append(_linear(attn.o_proj, weights, dims))
        weights.append(layer.post_attention_layernorm.weight.data)
        rows.append(_linear(mlp.gate_up_proj, weights, dims))
        rows.append(_linear(mlp.down_proj, weights, dims))
    if min(rows) < 1:  # a linear the op cannot run (0), or a packed copy without a GEMV
        return None
    return DecodeStack(
        weights, dims, backend.num_heads, backend.num_kv_heads, backend.head_dim, eps,
        float(backend.scale), int(backend.sliding_window or 0), min(rows),
    )  # fmt: skip
