"""What `--deterministic` (batch-invariant serving) runs on, and what it refuses.

A request's logits are a function of its own tokens only when every kernel of a step
reduces each row in an order fixed by that row alone. Under `--deterministic`:

- on CPU every dense linear runs one of our packed GEMMs at every row count
  (`kernels.cpu_ops.pack_linear_weight(fixed_order=True)`: the AMX GEMM where the CPU
  lends AMX tiles (16-row tiles, the last zero-padded), else the VNNI GEMM where it has
  AVX512-BF16, else the fp32-arithmetic one), each output a k-ordered chain; a
  quantized one runs the integer dot kernel at every row count (`kernels.ops.deterministic`);
- on the Triton path (CUDA) every linear, the head included, runs one Triton GEMM of
  one launch shape for every row count instead of cuBLAS (`kernels/triton/matmul.py`),
  a quantized weight dequantized into it;
- every token attends as a decode row (`AttentionBackend.prepare_rows`): one query over
  its causal context in the paged cache, in block order (the C++ kernel), or in KV
  tiles of a fixed length and never split (the Triton decode tile), so a prompt token's
  sums are the same in a whole prompt, a chunk, a tail after a cached prefix or a
  migration's replay, and equal those of its decode;
- norms, rotary, SiLU, the KV store, the head's argmax and the sampler work row by row
  on every path; a seeded request draws from its own generator;
- tensor-parallel ranks sum their partial products in rank order, element by element
  (`TpGroup(fixed_order=True)`), whatever the tensor's size;
- a mixture of experts runs each expert's rows through a row-invariant kernel (the
  small-M GEMV a few rows at a time on CPU, the one-shape GEMM on the Triton path),
  and each token's experts are added in the order of its top-k slots;
- latent attention (MLA) attends through the same rows, and its absorbed per-head
  projections run each head's rows through the row-invariant kernel;
- LoRA deltas are per row on both paths already (the C++ kernel's tiles of one slot
  sum each row alone; the Triton kernels give a row a program of fixed blocks), added
  to the row's base output.

The same engine as a prefill worker and as a decode worker therefore computes the same
KV and logits as an aggregated one. Refused, each with its reason: what has no
batch-invariant kernel yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig, ModelConfig

# the mode in the start-up log's kernel line
SUMMARY = "deterministic (batch-invariant: one fixed-order GEMM, batch-invariant attention)"
# and in `ModelRunner.kernel_paths` on the Triton path
TRITON_PATHS = {"gemm": "triton_batch_invariant", "attention": "batch_invariant"}


def check_loaded(model: torch.nn.Module) -> None:
    """Refuse, once the weights are in, what `--deterministic` cannot run: experts kept
    FP8 (their grouped kernel has no row-invariant form yet)."""
    from engine.models.moe import SparseMoE

    if any(isinstance(m, SparseMoE) and m.fp8 is not None for m in model.modules()):
        raise ValueError(
            "--deterministic does not serve FP8 experts yet (their grouped kernel sums "
            "rows by how many an expert gets); load the checkpoint dequantized"
        )


def kernel_paths(model: torch.nn.Module) -> dict[str, str]:
    """What `--deterministic` changes in `ModelRunner.kernel_paths` on CPU: the linears'
    one packed GEMM at every row count (its kinds), and the attention."""
    from engine.models.llama import Linear

    kinds = "+".join(sorted({m.packed.kind for m in model.modules()
                             if isinstance(m, Linear) and m.packed is not None}))  # fmt: skip
    return {"gemv": kinds, "gemm": kinds, "attention": "batch_invariant"}


def numerics(device: torch.device, dtype: torch.dtype, tp_size: int) -> str:
    """What a deterministic engine's bits depend on beyond the request's tokens: the
    kernels' build (a CPU ISA level's vector width and GEMM; a GPU model and Triton's
    compiler), the dtype and the tensor-parallel size (ranks sum their shards' partial
    products in rank order, so another split is another sum). Engines with the same
    string compute the same KV and logits for the same tokens: a decode worker takes a
    prefill worker's KV only from its own kind (`DETERMINISTIC_KEY` in discovery)."""
    from kernels import ops

    if ops.DEFAULT.selection.backend == "triton" and device.type != "cuda":
        kind = "triton-interpreter"
    elif device.type == "cuda":
        import torch
        import triton

        name = torch.cuda.get_device_name(device).replace(" ", "-")
        kind = f"cuda-{name}-triton-{triton.__version__}"
    else:
        from kernels import cpu_ops

        # the amx level runs the avx512_bf16 build, but its linears on the tile unit
        level = "amx" if cpu_ops.amx_gemm_available() else cpu_ops.cpu_build().level
        kind = f"cpu-{level}"
    return f"{kind}/{str(dtype).removeprefix('torch.')}/tp{tp_size}"


def check_config(config: EngineConfig) -> None:
    """Refuse, at parse time, what `--deterministic` cannot serve whatever the model."""
    if config.sim is not None:
        raise ValueError("--deterministic needs a real model; this engine is simulated")


def check_model(
    config: EngineConfig, model: ModelConfig, device: torch.device, dtype: torch.dtype
) -> None:
    """Refuse, at load, a model or device `--deterministic` has no batch-invariant
    kernels for; `dtype` is the engine's resolved one."""
    from kernels import ops

    if model.num_experts and config.expert_parallel:
        raise ValueError(
            "--deterministic does not serve experts spread over the ranks yet (drop "
            "--expert-parallel-size; experts split by width across TP ranks are served)"
        )
    if device.type == "cuda" or ops.DEFAULT.selection.backend == "triton":
        if not ops.triton_runs_on(device):
            raise ValueError(
                f"--deterministic on {device.type} needs the Triton kernels (the triton "
                "package; off CUDA only Triton's interpreter runs them, for tests)"
            )
        return
    _check_cpu(config, model, dtype)


def _check_cpu(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> None:
    import torch

    from kernels import cpu_ops, ops

    if dtype != torch.bfloat16:
        raise ValueError(
            f"--deterministic runs bfloat16 on CPU (got {str(dtype).removeprefix('torch.')}): "
            "our fixed-order GEMMs take bf16 weights; other dtypes run torch's linear, whose "
            "order changes with the batch"
        )
    if not cpu_ops.cpu_ops_available() or ops.DEFAULT.selection.backend != "auto":
        raise ValueError(
            "--deterministic needs the C++ CPU kernels (DIPTYCH_KERNELS=auto, and a build "
            "of them for this CPU)"
        )
    if not config.cpu_weight_prepack:
        raise ValueError(
            "--deterministic needs the packed weights (drop --no-weight-prepack): the "
            "fixed-order GEMMs run on them"
        )
    if model.num_experts and (model.hidden_size % 16 or model.moe_intermediate_size % 16):
        raise ValueError(
            "--deterministic runs experts on the row-invariant GEMV, which needs hidden "
            "and expert widths that are multiples of 16"
        )
    dim = model.kv_cache_dim if model.mla else model.head_dim  # what attention sums over
    if dim % 16 or dim > 256:
        raise ValueError(
            f"--deterministic needs an attention head dim that is a multiple of 16, at most "
            f"256 (the batch-invariant CPU kernel's); this model's is {dim}"
        )
    if model.mla and (model.qk_nope_head_dim % 16 or model.kv_lora_rank % 16):
        raise ValueError(
            "--deterministic runs latent attention's absorbed projections on the "
            "row-invariant GEMV, which needs nope and latent widths that are multiples of 16"
        )
