"""The sparse MLP of Qwen3-MoE and Mixtral: a router and its experts' stacked weights.

A layer's experts are held as two stacked parameters, ``w13`` [E, 2I, H] (each
expert's gate rows, then its up rows) and ``w2`` [E, H, I], so a step runs every chosen
expert's rows in two grouped GEMMs (`kernels.moe`). The router is a plain linear
[E, H]. Checkpoints store one tensor per expert and projection, under each family's
names; `expert_target` maps those onto the stacked parameters:

    model.layers.N.mlp.gate.weight                     (Qwen3-MoE)  the router
    model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
    model.layers.N.block_sparse_moe.gate.weight        (Mixtral)    the router
    model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight     (gate, up, down)

DeepSeek-V3 names its experts as Qwen3-MoE does; its router (`ModelConfig.router`
"sigmoid") also has ``mlp.gate.e_score_correction_bias``, and ``mlp.shared_experts``
is a dense MLP every token runs beside the routed experts.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from engine.config import ModelConfig
from engine.parallel.dispatch import dispatch_combine
from kernels import moe, ops
from kernels.quant import QuantTensor, cat_rows

if TYPE_CHECKING:
    from engine.models.llama import Linear
    from engine.parallel.group import TpGroup

# projection name -> (stacked parameter, which half of w13: 0 gate, 1 up; None: w2)
_PROJECTIONS = {
    "gate_proj": ("w13", 0), "w1": ("w13", 0),
    "up_proj": ("w13", 1), "w3": ("w13", 1),
    "down_proj": ("w2", None), "w2": ("w2", None),
}  # fmt: skip
_EXPERT = re.compile(r"^(.*\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_MIXTRAL_ROUTER = ".block_sparse_moe.gate."


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, router: Linear, tp: TpGroup | None = None) -> None:
        """`router`: a linear of hidden size in and `num_experts` out. With `tp`, `cfg`
        is the rank's shape (engine/parallel/shard.py): its slice of every expert's
        width, or its experts whole (`TpShard.experts`); the group adds up the ranks'
        partial sums."""
        super().__init__()
        self.tp = tp
        self.experts = range(cfg.num_experts) if tp is None else tp.shard.experts
        e, i, h = len(self.experts), cfg.moe_intermediate_size, cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.intermediate_size = i
        self.gate = router
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        # the experts kept FP8 instead (`keep_fp8`), and their parts while loading
        self.fp8: tuple[moe.Fp8Experts, moe.Fp8Experts] | None = None
        self.fp8_parts: dict[tuple[str, int, int | None], QuantTensor] = {}
        self.grouped = cfg.router == "sigmoid"
        self.groups = (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        if self.grouped:  # the router's choice bias, under the router's name
            router.e_score_correction_bias = nn.Parameter(
                torch.zeros(cfg.num_experts), requires_grad=False
            )
        self.num_experts = cfg.num_experts  # the model's (a rank's shape keeps the count)
        # tokens routed to each of the model's experts this step (`expert_load`)
        self.step_load: torch.Tensor | None = None
        self.shared_experts: nn.Module | None = None
        if cfg.n_shared_experts:
            from engine.models.llama import LlamaMLP

            # split like a dense MLP, summed by the MoE's all-reduce; with expert
            # parallelism whole, for the rank's share of the tokens (engine/parallel/dispatch.py)
            width = cfg.moe_intermediate_size * cfg.n_shared_experts
            self.shared_experts = LlamaMLP(dataclasses.replace(cfg, intermediate_size=width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate.run(x, fp32_out=True)
        if self.grouped:
            n_group, topk_group, scale = self.groups
            bias = cast(torch.Tensor, self.gate.e_score_correction_bias)
            weights, ids = moe.route_grouped(
                logits, bias, self.top_k, n_group, topk_group, self.renormalize, scale
            )
        else:
            weights, ids = moe.route(logits, self.top_k, self.renormalize)
        routed = torch.bincount(ids.flatten(), minlength=self.num_experts)
        self.step_load = routed if self.step_load is None else self.step_load + routed
        w13, w2 = self.fp8 if self.fp8 is not None else (self.w13, self.w2)
        if self.tp is not None and self.tp.shard.expert_parallel:
            return dispatch_combine(
                self.tp, x, weights, ids, len(self.experts),
                lambda rows, w, e: ops.fused_moe(rows, w13, w2, w, e, self.experts.start),
                self.shared_experts,
            )  # fmt: skip
        out = ops.fused_moe(x, w13, w2, weights, ids, self.experts.start)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def keep_fp8(self) -> None:
        """After loading: every expert's FP8 parts stacked (`kernels.moe.Fp8Experts`)
        and the dense stacks dropped; where some part is missing or does not stack
        (gate rows not whole tiles of 8), the parts dequantized into the dense stacks."""
        parts, self.fp8_parts = self.fp8_parts, {}
        if not parts:
            return
        e = self.w13.shape[0]
        need = [(p, x, h) for x in range(e) for p, h in (("w13", 0), ("w13", 1), ("w2", None))]
        try:
            if any(k not in parts for k in need):
                raise ValueError("some experts' parts are not FP8")
            w13 = moe.Fp8Experts.stack(
                [cat_rows([parts["w13", x, 0], parts["w13", x, 1]]) for x in range(e)]
            )
            w2 = moe.Fp8Experts.stack([parts["w2", x, None] for x in range(e)])
        except ValueError:
            for (param, x, half), q in parts.items():
                dst = self.expert_slice(param, x, half)
                dst.copy_(q.dequantize(dst.dtype).to(dst.device))
            return
        device = self.w13.device
        self.fp8 = (
            dataclasses.replace(w13, codes=w13.codes.to(device), scales=w13.scales.to(device)),
            dataclasses.replace(w2, codes=w2.codes.to(device), scales=w2.scales.to(device)),
        )
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)

    def expert_slice(self, param: str, expert: int, half: int | None) -> torch.Tensor:
        """The part of a stacked parameter one checkpoint tensor fills."""
        stacked: torch.Tensor = getattr(self, param)[expert]
        if half is None:
            return stacked
        i = self.intermediate_size
        return stacked.narrow(0, half * i, i)


def expert_load(model: nn.Module, ranks: int = 1) -> tuple[float, float] | None:
    """The last step's routing imbalance, its per-step counts cleared: over the sparse
    layers, the mean of (tokens of the busiest expert / tokens an expert would get if
    routing were even), and the same over `ranks` equal shares of the experts (an
    expert-parallel rank's). 1.0 is even; one decode token choosing k of E experts
    gives E/k. None if no sparse layer ran."""
    loads = []
    for m in model.modules():
        if isinstance(m, SparseMoE) and m.step_load is not None:
            loads.append(m.step_load)
            m.step_load = None
    if not loads:
        return None
    counts = torch.stack(loads).float()  # [layers, experts]
    mean = counts.mean(dim=1).clamp_min(1e-9)
    per_expert = (counts.amax(dim=1) / mean).mean()
    per_rank = counts.view(len(loads), ranks, -1).sum(-1)
    per_rank_imbalance = (per_rank.amax(dim=1) / per_rank.mean(dim=1).clamp_min(1e-9)).mean()
    return float(per_expert), float(per_rank_imbalance)


@dataclasses.dataclass
class ExpertLoadStats:
    """`expert_load` after every step, kept for the engine's snapshot: the last step's
    imbalance over experts and over `ranks` shares of them, and the running sums; with
    expert parallelism, the bytes this rank's all-to-alls sent other ranks (the last
    step's and in all)."""

    ranks: int = 1
    steps: int = 0
    last: float = 0.0
    last_rank: float = 0.0
    total: float = 0.0
    total_rank: float = 0.0
    all_to_all_bytes_last: int = 0
    all_to_all_bytes: int = 0

    def record(self, model: nn.Module, all_to_all_bytes: int = 0) -> None:
        """`all_to_all_bytes`: the rank's group's count so far (`TpGroup.all_to_all_bytes`)."""
        load = expert_load(model, self.ranks)
        if load is None:
            return
        self.last, self.last_rank = load
        self.steps += 1
        self.total += self.last
        self.total_rank += self.last_rank
        self.all_to_all_bytes_last = all_to_all_bytes - self.all_to_all_bytes
        self.all_to_all_bytes = all_to_all_bytes


def checkpoint_name(name: str) -> str:
    """A Mixtral router's name as the model's (``...mlp.gate.weight``)."""
    return name.replace(_MIXTRAL_ROUTER, ".mlp.gate.")


def expert_target(name: str) -> tuple[str, int, str, int | None] | None:
    """(layer's MLP path, expert, stacked parameter, half of w13) of an expert tensor's
    checkpoint name, or None for any other tensor."""
    m = _EXPERT.match(name)
    if m is None or m.group(3) not in _PROJECTIONS:
        return None
    param, half = _PROJECTIONS[m.group(3)]
    return f"{m.group(1)}mlp", int(m.group(2)), param, half


def filled(param: str, expert: int, half: int | None) -> str:
    """The key `load_expert` returns for one expert tensor of stacked parameter `param`
    (its full name), and the model's completeness check expects."""
    return f"{param}#{expert}.{half}"


def load_expert(
    model: nn.Module,
    name: str,
    tensor: torch.Tensor | QuantTensor,
    target: tuple[str, int, str, int | None],
) -> str:
    """Copy one expert tensor into its stacked parameter; the key it fills (as the
    model's completeness check counts them: ``<param>#<expert>.<half>``)."""
    mlp, expert, param, half = target
    try:
        module = model.get_submodule(mlp)
    except AttributeError:
        module = None
    if not isinstance(module, SparseMoE) or not 0 <= expert < module.w13.shape[0]:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    dst = module.expert_slice(param, expert, half)
    if isinstance(tensor, QuantTensor) and tensor.kind == "f8":  # stacked by `keep_fp8`
        if tensor.shape != tuple(dst.shape):
            raise ValueError(f"{name}: checkpoint shape {tensor.shape} != model "
                             f"{tuple(dst.shape)}")  # fmt: skip
        module.fp8_parts[param, expert, half] = tensor
        return filled(f"{mlp}.{param}", expert, half)
    if isinstance(tensor, QuantTensor):
        tensor = tensor.dequantize(dst.dtype).to(dst.device)
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model "
                         f"{tuple(dst.shape)}")  # fmt: skip
    dst.copy_(tensor)
    return filled(f"{mlp}.{param}", expert, half)
