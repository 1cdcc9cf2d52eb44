"""The knobs of a simulated engine (`EngineConfig.sim`): which timing model, how large
its KV bytes are here, how fast simulated time runs, when its text stops."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PROFILE = "H100:Llama-3.1-8B"


@dataclass
class SimConfig:
    """`profile`: a timing spec (`engine.sim.timing`: "ACCELERATOR:MODEL[:tpN]" or a
    `diptych profile` JSON file).

    `kv_scale`: the KV bytes written per token are the simulated model's, per GPU,
    times this (1/1024: a 70B model's 40 KB per token at TP8 becomes 40 bytes), so a
    fleet's pools fit in this machine's memory; the block count stays the device's.

    `speedup`: simulated seconds per wall second; a step of t simulated seconds
    sleeps t / speedup.

    `mean_output_tokens`: the simulated model ends a reply (an EOS token) at a
    deterministic, geometrically distributed length of this mean; 0 never does
    (`max_tokens` and the context window still end it).

    `virtual`: no KV memory, no KV writes and no sleeping; a step only records its
    simulated seconds (`SimModelRunner.last_step_s`) for a caller that keeps virtual
    time: the fleet simulator (`diptych simulate`).
    """

    profile: str = DEFAULT_PROFILE
    kv_scale: float = 1 / 1024
    speedup: float = 1.0
    mean_output_tokens: int = 256
    virtual: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_scale <= 1.0:
            raise ValueError(f"kv_scale must be in (0, 1], got {self.kv_scale}")
        if not self.speedup > 0.0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if self.mean_output_tokens < 0:
            raise ValueError("mean_output_tokens must be >= 0")
