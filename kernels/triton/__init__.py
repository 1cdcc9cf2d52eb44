"""Triton kernels for the CUDA hot path; `kernels.ops` dispatches to them.

Importing this package defines every kernel. Triton decides at definition time
whether a kernel is compiled for the GPU or run by its interpreter, so
TRITON_INTERPRET=1 must be set before the first import for the kernels to run on
CPU tensors (tests do this; `INTERPRETED` records which it was). `kernels.ops`
imports this package only when a Triton kernel is first wanted, so the CPU path
never pays for it. `kernels.triton.jit` gives the kernels their types.

Every launcher checks its arguments on the host (`contract`: index dtypes, devices,
shapes) and returns without launching on empty inputs.
"""

from __future__ import annotations

from triton.runtime.jit import JITFunction

from kernels.triton import contract, split_decode
from kernels.triton.activation import silu_and_mul
from kernels.triton.attention import det_attention, unified_attention
from kernels.triton.block_copy import copy_blocks, gather_blocks, scatter_blocks
from kernels.triton.fused_moe import fused_moe
from kernels.triton.kv_store import store_kv, store_kv_kernel
from kernels.triton.lora import lora_add_
from kernels.triton.matmul import batch_invariant_linear
from kernels.triton.norm import rms_norm
from kernels.triton.norm import supports as rms_norm_supports
from kernels.triton.quant_linear import quant_linear
from kernels.triton.rotary import rotary_

# True when the kernels were defined under TRITON_INTERPRET=1 (they then take CPU
# tensors and run slowly in numpy; bf16 arithmetic is wrong there).
INTERPRETED: bool = not isinstance(store_kv_kernel, JITFunction)

__all__ = [
    "INTERPRETED",
    "batch_invariant_linear",
    "contract",
    "copy_blocks",
    "det_attention",
    "fused_moe",
    "gather_blocks",
    "lora_add_",
    "quant_linear",
    "rms_norm",
    "rms_norm_supports",
    "rotary_",
    "scatter_blocks",
    "silu_and_mul",
    "split_decode",
    "store_kv",
    "unified_attention",
]
