"""Tensor parallelism's arithmetic: which heads, rows and columns each rank holds.

Megatron's split of a Llama-family layer over `size` ranks: the q/k/v and gate/up
projections are column-parallel (rank r computes its own heads and its slice of the
intermediate width), o and down are row-parallel (each rank's partial product, summed
by one all-reduce after attention and one after the MLP), and the embedding and head
are vocab-parallel (each rank holds a slice of the vocabulary, padded to equal slices).
A mixture of experts splits each expert as a dense MLP (its gate/up rows and down
columns: a slice of every expert's intermediate width a rank, summed by the MLP's
all-reduce), or with `expert_parallel` gives each rank `num_experts / size` experts
whole, and the shared experts whole too: a sparse layer then sends each token to the
ranks that hold its experts and back by all-to-all (engine/parallel/dispatch.py). Every
rank holds the whole router.
The KV cache follows the k/v heads: each rank stores only its own KV heads. With
fewer KV heads than ranks (GQA), each KV head is replicated on `size / kv_heads`
ranks, as vLLM does, so rank r's query heads always find their KV head locally.
Multi-head latent attention (DeepSeek) splits its query and kv_b_proj by heads; its
latent is one KV head, so every rank caches the whole latent.

This module holds only the split and its checks, as plain values (no process group):
`TpShard.local_config` is the per-rank model shape, `TpShard.shard` cuts a checkpoint
tensor (HF names) to what the rank loads, and `TpShard.kv_heads` is what its KV pool
holds, which a worker publishes so that a peer at another TP size can map its slices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from engine.config import ModelConfig, UnsupportedModelError
from engine.models.moe import expert_target
from engine.weights.fp8 import Fp8Published
from kernels.quant import QuantTensor, quantize_fp8
from protocol.kv_layout import kv_heads_of

# checkpoint name fragments, by how the tensor is split
_Q = (".q_proj.",)
_KV = (".k_proj.", ".v_proj.")
_COLUMN = (".gate_proj.", ".up_proj.")  # output rows split: the intermediate width
_ROW = (".o_proj.", ".down_proj.")  # input columns split, summed by the all-reduce
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# multi-head latent attention: the query and kv_b_proj split by heads (o_proj's input
# columns as above); q_a_proj, kv_a_proj_with_mqa and their norms whole on every rank,
# as is the latent cache (one KV head, replicated)
_MLA_HEADS = (".q_proj.", ".q_b_proj.", ".kv_b_proj.")


def check_tp(mc: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise UnsupportedModelError, naming the dimension, unless `mc` splits over
    `size` ranks: query heads and the intermediate widths evenly (with
    `expert_parallel`, the experts instead of their width), KV heads evenly or each
    replicated on an equal number of ranks."""
    if size < 1:
        raise UnsupportedModelError(f"tensor parallel size must be at least 1, got {size}")
    heads, kv = mc.num_attention_heads, mc.kv_cache_heads
    problems = []
    if heads % size:
        problems.append(f"{heads} attention heads do not split evenly over {size} ranks")
    if kv % size and size % kv:
        problems.append(
            f"{kv} KV heads neither split evenly over {size} ranks nor replicate evenly "
            f"({size} is not a multiple of {kv})"
        )
    if expert_parallel and mc.num_experts % size:
        problems.append(f"its {mc.num_experts} experts do not split evenly over {size} ranks")
    elif not expert_parallel and mc.moe_intermediate_size % size:
        problems.append(
            f"the experts' intermediate size {mc.moe_intermediate_size} does not split "
            f"evenly over {size} ranks"
        )
    shared = mc.n_shared_experts * mc.moe_intermediate_size
    if not expert_parallel and shared % size:
        problems.append(
            f"the shared experts' width {shared} does not split evenly over {size} ranks"
        )
    if mc.intermediate_size % size:
        problems.append(
            f"the MLP's intermediate size {mc.intermediate_size} does not split evenly "
            f"over {size} ranks"
        )
    if problems:
        raise UnsupportedModelError(
            f"{mc.name or mc.architecture} cannot run at tensor parallel size {size}: "
            + "; ".join(problems)
        )


@dataclass(frozen=True)
class TpShard:
    """Rank `rank` of `size`: the slices of `model` it holds."""

    model: ModelConfig
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        check_tp(self.model, self.size, self.expert_parallel)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.size})")

    # -- the split ----------------------------------------------------------------------

    @property
    def num_heads(self) -> int:
        return self.model.num_attention_heads // self.size

    @property
    def kv_heads(self) -> tuple[int, ...]:
        """The model's KV heads this rank holds (and its KV pool stores), in order."""
        return kv_heads_of(self.rank, self.size, self.model.kv_cache_heads)

    @property
    def intermediate_size(self) -> int:
        return self.model.intermediate_size // self.size

    @property
    def experts(self) -> range:
        """The experts this rank holds whole (with `expert_parallel`), else all of them
        (each as a slice of its width)."""
        e = self.model.num_experts
        if not self.expert_parallel:
            return range(e)
        n = e // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and head each rank holds: the vocabulary padded to a
        multiple of `size`."""
        return -(-self.model.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def local_config(self) -> ModelConfig:
        """The shape of this rank's layers: its query and KV heads, its slice of the MLP
        (the vocabulary stays the model's: the embedding and head say their own rows)."""
        return dataclasses.replace(
            self.model,
            num_attention_heads=self.num_heads,
            num_key_value_heads=len(self.kv_heads),
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.model.moe_intermediate_size
            // (1 if self.expert_parallel else self.size),
        )

    # -- a checkpoint's tensors ---------------------------------------------------------

    def weights(
        self, weights: Iterable[tuple[str, torch.Tensor | Fp8Published | QuantTensor]]
    ) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """A checkpoint's tensors cut to this rank's shard: dense ones, and FP8 ones as
        published (`shard_fp8`). Other quantized weights are not split
        (`ranks.check_parallel` refuses them at start)."""
        for name, t in weights:
            if isinstance(t, QuantTensor):
                raise ValueError(f"{name} is quantized: tensor parallelism cuts dense or FP8 "
                                 "weights")  # fmt: skip
            expert = expert_target(name) if self.expert_parallel else None
            if expert is not None:  # another rank's expert, or one of ours renumbered
                if expert[1] in self.experts:
                    local = _renumbered(name, expert[1] - self.experts.start)
                    yield local, t.quantized() if isinstance(t, Fp8Published) else t
                continue
            yield name, self.shard_fp8(name, t) if isinstance(t, Fp8Published) else self.shard(
                name, t
            )  # fmt: skip

    def cut(self, name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor `name` (HF names) this rank holds, or
        None where it holds it whole (norms and other vectors of the hidden width). The
        vocabulary's rows are `shard`'s (padded to equal slices)."""
        if self.size == 1:
            return None
        d = self.model.head_dim
        expert = expert_target(name)
        if expert is not None:  # gate and up: rows of the width; down: its columns
            n = self.model.moe_intermediate_size // self.size
            return (1 if expert[3] is None else 0), self.rank * n, n
        if self.expert_parallel and ".shared_experts." in name:
            return None  # whole on every rank: it runs the rank's tokens
        if self.model.mla and any(f in name for f in _MLA_HEADS):  # rows of its heads
            n = shape[0] // self.size
            return 0, self.rank * n, n
        if any(f in name for f in _Q):
            return 0, self.rank * self.num_heads * d, self.num_heads * d
        if any(f in name for f in _KV):
            return 0, self.kv_heads[0] * d, len(self.kv_heads) * d
        if any(f in name for f in _COLUMN):  # a dense MLP's width, or the shared experts'
            n = shape[0] // self.size
            return 0, self.rank * n, n
        if any(f in name for f in _ROW):
            n = shape[1] // self.size
            return 1, self.rank * n, n
        return None

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The part of dense checkpoint tensor `name` (HF names) this rank loads."""
        if self.size > 1 and name in _VOCAB:
            rows = tensor.narrow(0, self.vocab_start, max(0, min(
                self.vocab_rows, tensor.shape[0] - self.vocab_start)))  # fmt: skip
            if rows.shape[0] == self.vocab_rows:
                return rows.contiguous()
            pad = rows.new_zeros((self.vocab_rows - rows.shape[0], *rows.shape[1:]))
            return torch.cat([rows, pad])  # the padding's logits are cut after the gather
        cut = self.cut(name, tuple(tensor.shape))
        return tensor if cut is None else tensor.narrow(*cut).contiguous()

    def shard_fp8(self, name: str, w: Fp8Published) -> QuantTensor:
        """This rank's part of an FP8 weight, kept FP8: its codes and scales cut exactly
        where the scales' blocks fall whole on one side of the cut (per-tensor and
        per-channel scales always; 128x128 blocks when the shard is whole blocks), else
        dequantized, cut and quantized again per output channel (within e4m3's rounding)."""
        if self.size == 1:
            return w.quantized()
        if name in _VOCAB:
            return quantize_fp8(self.shard(name, w.dense()))
        cut = self.cut(name, tuple(w.codes.shape))
        if cut is None:
            return w.quantized()
        exact = w.narrow(*cut)
        return exact.quantized() if exact is not None else quantize_fp8(
            self.shard(name, w.dense())
        )  # fmt: skip


def _renumbered(name: str, local: int) -> str:
    """An expert tensor's name with the expert's index among this rank's."""
    head, tail = name.split(".experts.", 1)
    return f"{head}.experts.{local}.{tail.split('.', 1)[1]}"
