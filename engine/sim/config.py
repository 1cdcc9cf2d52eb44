"""The knobs of a simulated engine (`EngineConfig.sim`): which timing model, how large
its KV bytes are here, how fast simulated time runs, when its text stops."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.declare import check_fields, spec

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

    profile: str = spec(
        DEFAULT_PROFILE,
        help="--engine sim's timing: ACCELERATOR:MODEL[:tpN] (a roofline of shipped data, "
        "e.g. H200:Llama-3.1-70B:tp8) or a `diptych profile` JSON",
    )
    kv_scale: float = spec(
        1 / 1024, lo=0.0, lo_open=True, hi=1.0, flag="sim-kv-scale",
        help="--engine sim: KV bytes written per token, as a fraction of the device's",
    )  # fmt: skip
    speedup: float = spec(
        1.0, lo=0.0, lo_open=True, flag="time-scale",
        help="--engine sim: simulated seconds per wall second (time dilation)",
    )  # fmt: skip
    mean_output_tokens: int = spec(
        256, lo=0, flag="sim-mean-output-tokens",
        help="--engine sim: mean reply length before the simulated model's EOS (0: never)",
    )  # fmt: skip
    virtual: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
