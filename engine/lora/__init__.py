"""Multi-LoRA serving: adapters read from PEFT directories (`adapter`), stacked in
device slots that every targetable linear reads in one kernel call per step for any mix
of adapters (`slots`), and paged between their directories, host memory and the slots
(`manager`)."""

from engine.lora.adapter import LoraAdapter, load_adapter
from engine.lora.manager import AdapterStats, LoraManager
from engine.lora.slots import LoraBatch, LoraSlots, LoraStack

__all__ = [
    "AdapterStats",
    "LoraAdapter",
    "LoraBatch",
    "LoraManager",
    "LoraSlots",
    "LoraStack",
    "load_adapter",
]
