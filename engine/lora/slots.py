"""The device side of multi-LoRA: every linear's adapters stacked in `max_loras` slots.

Each targetable linear of each decoder layer gets a `LoraStack` (its A and B for every
slot, in the layout `kernels.lora` takes) when the engine starts with LoRA enabled, so
memory is fixed up front: slots x max rank x (in + out) of every linear. Loading an
adapter into a slot writes its matrices there (zeros for the linears it does not
target); the step's `LoraBatch` says which slot each row uses, and each linear adds
the rows' deltas after its base GEMM, one kernel call for the whole mixed batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.lora.adapter import TARGETS, LoraAdapter
from kernels import ops
from protocol.errors import InvalidInput

if TYPE_CHECKING:
    from engine.models.llama import Linear, LlamaForCausalLM


@dataclass
class LoraBatch:
    """This step's rows: `slots` [T] (-1: the base model), None when no row uses an
    adapter; `active` the slots in use."""

    slots: torch.Tensor | None = None
    active: frozenset[int] = frozenset()


@dataclass
class LoraStack:
    """One linear's adapters: a [S, J*R, K], b [S, R, N] (see `kernels.lora`), its
    output slices' column bounds, and the slots that hold weights for it."""

    batch: LoraBatch
    a: torch.Tensor
    b: torch.Tensor
    bounds: tuple[int, ...]
    live: set[int] = field(default_factory=set)

    @classmethod
    def build(
        cls, batch: LoraBatch, slots: int, rank: int, in_features: int, sizes: list[int],
        dtype: torch.dtype, device: torch.device,
    ) -> LoraStack:  # fmt: skip
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        a = torch.zeros(slots, len(sizes) * rank, in_features, dtype=dtype, device=device)
        b = torch.zeros(slots, rank, bounds[-1], dtype=dtype, device=device)
        return cls(batch, a, b, tuple(bounds))

    @property
    def rank(self) -> int:
        return int(self.b.shape[1])

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Add this step's adapter rows' deltas to `out` (the base output of `x`)."""
        batch = self.batch
        if batch.slots is not None and not self.live.isdisjoint(batch.active):
            ops.lora_add_(out, x, self.a, self.b, batch.slots, self.bounds)

    def clear(self, slot: int) -> None:
        if slot in self.live:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.live.discard(slot)

    def fill(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice `part`'s A [r, K] and scaled B [out, r] into `slot`."""
        r, rank = a.shape[0], self.rank
        lo, hi = self.bounds[part], self.bounds[part + 1]
        self.a[slot, part * rank : part * rank + r].copy_(a)
        self.b[slot, :r, lo:hi].copy_(b.t())
        self.live.add(slot)

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


class LoraSlots:
    """Every linear's `LoraStack`, attached to the model's linears (`Linear.lora`)."""

    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_rank: int) -> None:
        from engine.models.llama import LlamaAttention, LlamaMLP

        cfg = model.config
        weight = model.model.norm.weight
        self.batch = LoraBatch()
        self.num_slots, self.max_rank = num_slots, max_rank
        self.num_layers = cfg.num_hidden_layers
        # (layer, fused linear name) -> its stack
        self.stacks: dict[tuple[int, str], LoraStack] = {}
        for n, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears: list[tuple[str, Linear, list[int]]] = []
            if isinstance(attn, LlamaAttention):
                linears += [("qkv_proj", attn.qkv_proj, [attn.q_size, attn.kv_size, attn.kv_size]),
                            ("o_proj", attn.o_proj, [attn.o_proj.out_features])]  # fmt: skip
            if isinstance(mlp, LlamaMLP):
                i = mlp.intermediate_size
                linears += [("gate_up_proj", mlp.gate_up_proj, [i, i]),
                            ("down_proj", mlp.down_proj, [mlp.down_proj.out_features])]  # fmt: skip
            for name, lin, sizes in linears:
                stack = LoraStack.build(self.batch, num_slots, max_rank, lin.in_features,
                                        sizes, weight.dtype, weight.device)  # fmt: skip
                lin.lora = stack
                self.stacks[(n, name)] = stack

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stacks.values())

    def check(self, adapter: LoraAdapter) -> None:
        """Raise InvalidInput unless every module of `adapter` fits this model."""
        for (layer, module), (a, b) in adapter.weights.items():
            stack = self.stacks.get((layer, TARGETS[module][0]))
            if stack is None:
                where = (
                    f"layer {layer}"
                    if layer < self.num_layers
                    else f"layer {layer} (the model has {self.num_layers})"
                )
                raise InvalidInput(f"LoRA adapter {adapter.name!r} targets {module} of {where}, "
                                   "which this model cannot adapt")  # fmt: skip
            part = TARGETS[module][1]
            out = stack.bounds[part + 1] - stack.bounds[part]
            if a.shape[1] != stack.a.shape[2] or b.shape[0] != out:
                raise InvalidInput(
                    f"LoRA adapter {adapter.name!r}: layer {layer} {module} maps "
                    f"{a.shape[1]} -> {b.shape[0]}, the model's {stack.a.shape[2]} -> {out} "
                    "(an adapter of another base model?)"
                )
            if a.shape[0] > self.max_rank:
                raise InvalidInput(f"LoRA adapter {adapter.name!r} has rank {a.shape[0]}; "
                                   f"--max-lora-rank is {self.max_rank}")  # fmt: skip

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot` of every stack (zeros where it has no module)."""
        for stack in self.stacks.values():
            stack.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            fused, part = TARGETS[module]
            stack = self.stacks[(layer, fused)]
            stack.fill(slot, part, a.to(stack.a.dtype), b.to(stack.b.dtype))

    def set_step(self, slots: torch.Tensor | None, active: frozenset[int]) -> None:
        self.batch.slots, self.batch.active = slots, active
