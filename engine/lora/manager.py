"""Adapter paging: host memory (`--max-cpu-loras`, LRU) and device slots
(`--max-loras`, LRU), and what each adapter did (its metrics).

    request (AdapterRef) --prepare--> host cache (read from its directory, checked)
    step's adapters      --activate--> device slots (copied in, the least recently
                                       used slot that this step does not use evicted)

`prepare` runs when a request is submitted: a bad adapter fails that request at once
(InvalidInput, its reason). An adapter a request in the engine refers to stays in host
memory whatever the cap, so a step never reads files. The scheduler keeps at most
`max_loras` adapters among the running requests (a request for another waits, counted
in `slot_waits`), so `activate` always finds a slot for each of the step's adapters.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.lora.adapter import LoraAdapter, load_adapter
from engine.lora.slots import LoraSlots
from protocol.lora import AdapterRef

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM
    from engine.request import Request

log = logging.getLogger(__name__)
STARTUP = logging.getLogger("diptych.startup")


@dataclass
class AdapterStats:
    """One adapter's counters since start (per-adapter metrics)."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    loads: int = 0  # copies into a device slot
    evictions: int = 0  # out of a device slot, for another adapter
    host_loads: int = 0  # reads from its directory into host memory
    slot_waits: int = 0  # requests that waited for a slot (the max_loras cap)


class LoraManager:
    def __init__(
        self, slots: LoraSlots, max_cpu_loras: int, in_use: Callable[[], Iterable[AdapterRef]]
    ) -> None:
        self.slots = slots
        self.max_cpu_loras = max(max_cpu_loras, slots.num_slots)
        self.in_use = in_use  # adapters the engine's requests refer to
        self.host: OrderedDict[AdapterRef, LoraAdapter] = OrderedDict()
        self.resident: list[AdapterRef | None] = [None] * slots.num_slots
        self._last_used = [0] * slots.num_slots
        self._steps = 0
        self.stats: dict[str, AdapterStats] = {}
        self.mixed_steps = 0  # steps whose rows used two adapters or more

    @classmethod
    def for_model(
        cls, model: LlamaForCausalLM, max_loras: int, max_rank: int, max_cpu_loras: int,
        in_use: Callable[[], Iterable[AdapterRef]],
    ) -> LoraManager:  # fmt: skip
        """Slots on every targetable linear of `model`, its steps reading their batch."""
        slots = LoraSlots(model, max_loras, max_rank)
        model.model.lora_batch = slots.batch
        STARTUP.info("LoRA: %d slots of rank %d, %.0f MB", max_loras, max_rank,
                     slots.nbytes / 1e6)  # fmt: skip
        return cls(slots, max_cpu_loras, in_use)

    def waited(self, req: Request) -> None:
        """`req` waits for a slot (the scheduler's `on_lora_wait`)."""
        if req.lora is not None:
            self.stats_of(req.lora.name).slot_waits += 1

    @property
    def max_loras(self) -> int:
        return self.slots.num_slots

    def stats_of(self, name: str) -> AdapterStats:
        found = self.stats.get(name)
        if found is None:
            found = self.stats[name] = AdapterStats()
        return found

    def prepare(self, ref: AdapterRef) -> LoraAdapter:
        """`ref` in host memory, read and checked on first use (raises InvalidInput)."""
        adapter = self.host.get(ref)
        if adapter is not None:
            self.host.move_to_end(ref)
            return adapter
        started = time.perf_counter()
        adapter = load_adapter(ref.name, ref.path, self.slots.max_rank)
        self.slots.check(adapter)
        self.host[ref] = adapter
        self.stats_of(ref.name).host_loads += 1
        log.info("LoRA adapter %s (rank %d, %s) read from %s in %.0f ms", ref.name,
                 adapter.rank, "+".join(sorted(adapter.modules)), ref.path,
                 (time.perf_counter() - started) * 1e3)  # fmt: skip
        self.trim_host()
        return adapter

    def trim_host(self) -> None:
        """Drop the least recently used host copies past `max_cpu_loras` that no
        request refers to (called as requests finish: their adapters then may go)."""
        if len(self.host) <= self.max_cpu_loras:
            return
        keep = set(self.in_use()) | {r for r in self.resident if r is not None}
        for ref in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                break
            if ref not in keep:
                del self.host[ref]

    def slot_of(self, ref: AdapterRef) -> int | None:
        try:
            return self.resident.index(ref)
        except ValueError:
            return None

    def activate(self, refs: set[AdapterRef]) -> dict[AdapterRef, int]:
        """A device slot for each of a step's adapters (at most `max_loras`), loading
        the missing ones over the least recently used slots this step does not use."""
        if len(refs) > self.max_loras:
            raise RuntimeError(
                f"a step holds {len(refs)} LoRA adapters, the slots {self.max_loras}"
            )
        self._steps += 1
        out: dict[AdapterRef, int] = {}
        missing = []
        for ref in refs:
            slot = self.slot_of(ref)
            if slot is None:
                missing.append(ref)
            else:
                out[ref] = slot
        for ref in missing:
            taken = set(out.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            slot = min(free, key=lambda s: (self.resident[s] is not None, self._last_used[s]))
            old = self.resident[slot]
            if old is not None:
                self.stats_of(old.name).evictions += 1
            adapter = self.prepare(ref)
            self.slots.load(slot, adapter)
            self.resident[slot] = ref
            self.stats_of(ref.name).loads += 1
            out[ref] = slot
        for slot in out.values():
            self._last_used[slot] = self._steps
        return out

    def step_slots(
        self, refs: list[AdapterRef | None], lens: list[int], device: torch.device
    ) -> tuple[torch.Tensor | None, frozenset[int]]:
        """The per-row slot tensor of a step whose sequences (in step order) use
        `refs` and compute `lens` rows each; (None, empty) when none uses an adapter."""
        used = {r for r in refs if r is not None}
        if not used:
            return None, frozenset()
        where = self.activate(used)
        self.mixed_steps += len(used) > 1
        per_seq = torch.tensor([-1 if r is None else where[r] for r in refs], dtype=torch.int64)
        rows = torch.repeat_interleave(per_seq, torch.tensor(lens, dtype=torch.int64))
        return rows.to(device), frozenset(where.values())

    def resident_names(self) -> list[str]:
        return sorted({r.name for r in self.resident if r is not None})
