"""The simulated model runner: the real runner's seam, with the forward pass replaced by
a timing model.

Everything around it stays the real code: the scheduler picks the step, the KV cache
manager allocates and caches its blocks, the worker moves its KV through the transfer
layer. `execute` then

  - asks the timing model how long the step takes on the simulated hardware and sleeps
    that long (divided by the speed-up), measured from the call, so host overhead comes
    on top as it would on a GPU host that does not overlap scheduling;
  - writes every computed token's KV into its slot (bytes of an honest size: the
    simulated model's KV per token, times `SimConfig.kv_scale`, a value derived from
    the token) so remote prefills move real data;
  - samples, for each request that samples, the deterministic token of
    `engine.sim.tokens` at its next position.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
import weakref
from collections.abc import Callable

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache.layout import KvAllocator, pool_tensor, read_block_bytes, write_block_bytes
from engine.model_runner import StepResult
from engine.request import Request
from engine.scheduler import SchedulerOutput
from engine.sim.config import SimConfig
from engine.sim.timing import TimingModel
from engine.sim.tokens import natural_length, prompt_key, token_at
from protocol.kv_layout import KvLayout
from protocol.logprobs import TokenLogprob, TopLogprob

log = logging.getLogger(__name__)
_JITTER_SEED = 0x5EED  # one fixed seed: the same run gives the same times

_DTYPE = torch.bfloat16
# a KV tier's host-to-device copies: PCIe 5 x16's ~64 GB/s, at about 80 %
HOST_LINK_BYTES_PER_S = 50e9


def simulated_model(
    timing: TimingModel, tokenizer_model: ModelConfig, eos_token_ids: tuple[int, ...] | None = None
) -> ModelConfig:
    """The simulated architecture, speaking the tokenizer model's vocabulary (and its
    EOS ids, or the owner's `eos_token_ids`)."""
    eos = tokenizer_model.eos_token_ids if eos_token_ids is None else tuple(eos_token_ids)
    return dataclasses.replace(
        timing.model,
        vocab_size=tokenizer_model.vocab_size,
        bos_token_id=tokenizer_model.bos_token_id,
        eos_token_ids=eos,
        name=f"sim:{timing.name}",
    )


def sim_layout(timing: TimingModel, sim: SimConfig, config: EngineConfig, name: str) -> KvLayout:
    """One bf16 "head" per token whose width carries the scaled KV bytes; the device's
    KV capacity in blocks unless `config.num_blocks` says otherwise."""
    bytes_per_token = timing.kv_bytes_per_token * sim.kv_scale
    head_dim = max(1, round(bytes_per_token / (2 * _DTYPE.itemsize)))
    num_blocks = config.num_blocks or 1 + timing.kv_capacity_tokens() // config.block_size
    if num_blocks < 2:
        raise ValueError(f"{timing.name} has no room for KV after its weights")
    return KvLayout(num_blocks, 1, config.block_size, 1, head_dim, "bfloat16", name)


class SimModelRunner:
    def __init__(
        self,
        timing: TimingModel,
        model_config: ModelConfig,
        config: EngineConfig,
        kv_pool: torch.Tensor | None = None,
        kv_allocator: KvAllocator | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        assert config.sim is not None
        self.sim = config.sim
        self.timing = timing
        self.model_config = model_config
        self.block_size = config.block_size
        self.device = torch.device("cpu")
        self.layout = sim_layout(timing, config.sim, config, model_config.name)
        if kv_pool is not None:
            self.layout = self.layout.with_blocks(
                kv_pool.numel() * kv_pool.element_size() // self.layout.block_bytes
            )
        elif kv_allocator is not None and not self.sim.virtual:
            memory = kv_allocator(self.layout.total_bytes, 0)
            kv_pool = None if memory is None else memory.tensor
        self.kv_pool = (
            torch.empty(0, dtype=_DTYPE)
            if self.sim.virtual
            else pool_tensor(self.layout, self.device, kv_pool)
        )
        self._clock, self._sleep = clock, sleep
        # every runner draws the same seeded sequence: a simulation repeats exactly
        self._jitter = random.Random(_JITTER_SEED)
        self.busy_s = 0.0  # simulated seconds of forward passes so far
        self._restore_s = 0.0  # KV tier restores since the last step (`write_blocks`)
        self.last_step_s = 0.0
        eos = set(model_config.eos_token_ids)
        self._keys: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._filler = next(t for t in range(model_config.vocab_size - 1, -1, -1) if t not in eos)
        log.info("%s", self.kernel_summary())

    @property
    def tier_block_bytes(self) -> int:
        """A block's bytes on the simulated device (what a KV tier's budget counts)."""
        return max(1, round(self.timing.kv_bytes_per_token * self.block_size))

    def read_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """As `ModelRunner.read_blocks`; a virtual pool has no bytes: empty rows."""
        if self.sim.virtual:
            return [torch.empty(0, dtype=torch.uint8) for _ in block_ids]
        return read_block_bytes(self.kv_pool, block_ids)

    def write_blocks(self, block_ids: list[int], rows: list[torch.Tensor]) -> None:
        """As `ModelRunner.write_blocks`; the copy's simulated time (the device's
        bytes over the host link) is added to the next step."""
        self._restore_s += len(block_ids) * self.tier_block_bytes / HOST_LINK_BYTES_PER_S
        if not self.sim.virtual:
            write_block_bytes(self.kv_pool, block_ids, rows)

    def kernel_paths(self) -> dict[str, str]:
        return {
            "device": "sim",
            "timing": self.timing.name,
            "kv_bytes_per_token": str(self.layout.block_bytes // self.block_size),
            "speedup": f"{self.sim.speedup:g}",
        }

    def kernel_summary(self) -> str:
        p = self.kernel_paths()
        return (
            f"simulated engine: {p['timing']}, {self.layout.num_blocks} KV blocks of "
            f"{p['kv_bytes_per_token']} bytes/token (x{self.sim.kv_scale:g} of the device's), "
            f"time x{p['speedup']}"
        )

    def step_seconds(self, sched: SchedulerOutput) -> float:
        """Simulated seconds of this step's forward pass (with its jitter drawn)."""
        seconds = self.timing.step_s([(s.num_new_tokens, s.start) for s in sched.scheduled])
        restore, self._restore_s = self._restore_s, 0.0  # a KV tier's copies, not overlapped
        return seconds * self._jitter_factor() + restore

    def _jitter_factor(self) -> float:
        sigma = self.timing.jitter_sigma
        return math.exp(sigma * self._jitter.gauss(0.0, 1.0)) if sigma else 1.0

    def execute(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> StepResult:
        started = self._clock()
        seconds = self.last_step_s = self.step_seconds(sched)
        self.busy_s += seconds
        result = StepResult({}, {}, {})
        if not self.sim.virtual:
            self._write_kv(sched, block_ids)
        for s in sched.scheduled:
            if s.samples:
                self._sample(s.request, s.start + s.num_new_tokens, result)
        if self.sim.virtual:
            return result
        left = started + seconds / self.sim.speedup - self._clock()
        if left > 0:
            self._sleep(left)
        return result

    def decode_run(
        self, sched_running: list[Request], steps: int
    ) -> tuple[float, dict[str, list[int]]]:
        """`steps` decode steps of these running requests at once (virtual mode): their
        simulated seconds, and each request's tokens. The contexts grow by one per step;
        the run is priced at its middle step (exact where the step time is linear in
        context, as the roofline's and a profile's are between grid points). All but
        the last token are a filler: only lengths reach a simulated client. The run's
        steps share one draw of the timing's jitter."""
        half = (steps - 1) / 2
        chunks = [(1, int(r.num_computed_tokens + half)) for r in sched_running]
        seconds = steps * self.timing.step_s(chunks) * self._jitter_factor()
        tokens = {}
        for r in sched_running:
            last = StepResult({}, {}, {})
            self._sample(r, r.num_tokens + steps - 1, last)
            tokens[r.request_id] = [self._filler] * (steps - 1) + [last.tokens[r.request_id]]
        return seconds, tokens

    def max_decode_steps(self, req: Request) -> int:
        """Decode steps before the request's natural EOS could come (a run ends there)."""
        if req.sampling_params.ignore_eos:
            return 1 << 30
        length = natural_length(self._key(req), self.sim.mean_output_tokens)
        return 1 << 30 if length is None else max(length - req.num_output_tokens, 1)

    def _write_kv(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]) -> None:
        """Every computed token's KV slot gets a value derived from its token, in one
        indexed write for the whole step (a decode step writes one slot per request)."""
        bs = self.block_size
        blocks: list[int] = []
        offsets: list[int] = []
        values: list[int] = []
        runs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for s in sched.scheduled:
            ids, n = s.request.all_token_ids, s.num_new_tokens
            table = block_ids[s.request.request_id]
            if n == 1:
                block, off = divmod(s.start, bs)
                blocks.append(table[block])
                offsets.append(off)
                values.append(ids[s.start])
            elif n > 1:
                pos = torch.arange(s.start, s.start + n)
                runs.append(
                    (
                        torch.tensor(table)[pos // bs],
                        pos % bs,
                        torch.tensor(ids[s.start : s.start + n]),
                    )
                )
        if blocks:
            runs.append((torch.tensor(blocks), torch.tensor(offsets), torch.tensor(values)))
        if not runs:
            return
        b, o, v = (torch.cat(part) for part in zip(*runs, strict=True))
        self.kv_pool[b, 0, :, o] = v.remainder_(251).to(_DTYPE).view(-1, 1, 1, 1)

    def _key(self, req: Request) -> int:
        """The request's text key (`engine.sim.tokens`), computed once per request."""
        key = self._keys.get(req)
        if key is None:
            params = req.sampling_params
            key = prompt_key(req.prompt_token_ids, None if params.greedy else params.seed)
            self._keys[req] = key
        return key

    def _sample(self, req: Request, position: int, result: StepResult) -> None:
        params = req.sampling_params
        key = self._key(req)
        vocab, mean = self.model_config.vocab_size, self.sim.mean_output_tokens
        eos = self.model_config.eos_token_ids
        token = token_at(key, position, position - req.num_prompt_tokens, vocab, eos, mean)
        if req.reasoning is not None:
            # the simulated model never ends its thinking itself (a run of fast-forwarded
            # steps could not see it): its budget does, with the end marker
            if token in params.reasoning_end:
                token = self._filler
            token = req.reasoning.next_token(token, req.stop_ids)
        rid = req.request_id
        result.tokens[rid] = token
        if params.logprobs is not None:
            n = params.logprobs
            others = [token_at(key ^ (i + 1), position, 0, vocab, (), 0) for i in range(n)]
            top = [(token, -0.25)] + [(t, -2.0 - i) for i, t in enumerate(others) if t != token]
            result.logprobs[rid] = TokenLogprob(
                token, -0.25, 1, tuple(TopLogprob(*t) for t in top[:n])
            )
        if params.output_logits:
            row = torch.full((vocab,), -30.0)
            row[token] = 0.0
            result.logits[rid] = row
