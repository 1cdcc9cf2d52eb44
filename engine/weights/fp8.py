"""FP8 checkpoints as they ship, read from their `quantization_config`.

Three layouts cover the FP8 checkpoints on the hub:

    quant_method "fp8"                       <linear>.weight float8_e4m3fn and
                                             <linear>.weight_scale, one fp32 scalar
    quant_method "fp8", weight_block_size    <linear>.weight_scale_inv fp32
        [128, 128] (DeepSeek-V3/R1, Qwen3 FP8)   [ceil(N/128), ceil(K/128)], a multiplier
                                             despite its name
    quant_method "compressed-tensors",       <linear>.weight_scale: [1] (strategy
        format "float-quantized", 8-bit       "tensor"), [N, 1] ("channel") or the
        float weights (vLLM's llm-compressor) block grid ("block", block_structure)

In every one w = scale * code. Linears not quantized (the embedding, the head, a MoE
router) are stored in bf16 beside them. Activation scales (`input_scale`, a static
w8a8 scheme's) are not needed: the kernels keep activations in floating point (w8a16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.quant import FP8, QuantTensor, fp8_from_checkpoint

# Checkpoint tensors that only serve the w8a8 schemes' activation quantization.
ACTIVATION_SCALES = (".input_scale",)


@dataclass(frozen=True)
class Fp8Scheme:
    """How a checkpoint's FP8 linears are scaled."""

    source: str  # reported as the weights' format: "fp8", "fp8 128x128", ...
    scale_suffix: str  # appended to a weight's name: "_scale" or "_scale_inv"
    block: tuple[int, int] | None  # (rows, columns) a scale covers; None: tensor / channel

    def scale_name(self, weight: str) -> str:
        return weight + self.scale_suffix

    def is_scale(self, name: str) -> bool:
        return name.endswith(".weight" + self.scale_suffix) or name.endswith(ACTIVATION_SCALES)

    def quantized(self, codes: torch.Tensor, scale: torch.Tensor) -> QuantTensor:
        """The weight kept FP8 (`kernels.quant`, kind "f8")."""
        return fp8_from_checkpoint(codes, scale, self.source, self.block)

    def dense(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The weight dequantized to fp32 (a tensor-parallel shard is cut from it)."""
        return self.quantized(codes, scale).dequantize()


@dataclass(frozen=True)
class Fp8Published:
    """One FP8 weight as its checkpoint holds it: codes [N, K] e4m3 and their scale
    (a scalar, one per row, or a block grid, as `scheme` says), so that a
    tensor-parallel rank cuts its shard out of the codes exactly (`narrow`)."""

    codes: torch.Tensor
    scale: torch.Tensor
    scheme: Fp8Scheme

    def narrow(self, dim: int, start: int, length: int) -> Fp8Published | None:
        """Rows (dim 0) or columns (dim 1) [start, start + length), with their scales;
        None where a scale block straddles either edge (its scale is shared with codes
        left out, and cannot be cut)."""
        codes = self.codes.narrow(dim, start, length)
        scale = self.scale
        if self.scheme.block is not None:
            b = self.scheme.block[dim]
            end = start + length
            if start % b or (end % b and end != self.codes.shape[dim]):
                return None
            scale = scale.narrow(dim, start // b, -(-length // b))
        elif dim == 0 and scale.numel() > 1:  # one scale a row
            scale = scale.reshape(-1).narrow(0, start, length)
        return Fp8Published(codes.contiguous(), scale.contiguous(), self.scheme)

    def quantized(self) -> QuantTensor:
        return self.scheme.quantized(self.codes, self.scale)

    def dense(self) -> torch.Tensor:
        return self.scheme.dense(self.codes, self.scale)


def _block(value: Any, where: str) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2
            and all(isinstance(v, int) and v > 0 for v in value)):  # fmt: skip
        raise ValueError(f"{where} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def fp8_scheme(hf_config: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a HF `config.json`, or None for an unquantized checkpoint.
    Other quantization methods (AWQ, GPTQ, bitsandbytes, ...) are refused by name."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 format {qc.get('fmt')!r} is not supported (e4m3 is)")
        block = qc.get("weight_block_size")
        if block is None:
            return Fp8Scheme("fp8", "_scale", None)
        bn, bk = _block(block, "weight_block_size")
        return Fp8Scheme(f"fp8 {bn}x{bk}", "_scale_inv", (bn, bk))
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(
        f"checkpoint quantization {method!r} is not supported; FP8 checkpoints "
        "(quant_method 'fp8', or 'compressed-tensors' with 8-bit float weights) are"
    )


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Scheme:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if fmt != "float-quantized" or not weights or any(
        w.get("type") != "float" or w.get("num_bits") != 8 for w in weights
    ):
        raise ValueError(
            f"compressed-tensors format {fmt!r} is not supported; its FP8 scheme is "
            "(format 'float-quantized', 8-bit float weights)"
        )
    strategies = {w.get("strategy") for w in weights}
    if len(strategies) != 1 or not strategies <= {"tensor", "channel", "block"}:
        raise ValueError(f"compressed-tensors weight strategies {sorted(map(str, strategies))} "
                         "are not supported (one of tensor, channel, block)")  # fmt: skip
    strategy = strategies.pop()
    if strategy == "block":
        bn, bk = _block(weights[0].get("block_structure"), "block_structure")
        return Fp8Scheme(f"fp8 {bn}x{bk}", "_scale", (bn, bk))
    return Fp8Scheme(f"fp8 per-{strategy}", "_scale", None)


def check_codes(name: str, tensor: torch.Tensor, scheme: Fp8Scheme | None) -> None:
    """An FP8 tensor is an e4m3 weight of a checkpoint that says it has them."""
    if tensor.dtype != FP8:
        raise ValueError(f"{name} is {tensor.dtype}; only float8_e4m3fn weights are supported")
    if scheme is None:
        raise ValueError(f"{name} is FP8 but config.json has no quantization_config")
