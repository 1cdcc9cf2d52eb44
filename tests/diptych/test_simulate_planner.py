"""The planner core driving the simulated fleet: each pool follows its own load, and
the fleet returns to its minimum when traffic stops, losing no request."""

from __future__ import annotations

from bench.workloads import WorkloadSpec
from diptych.simulate.fleet import Fleet, FleetConfig
from diptych.simulate.planning import SimPlanning, capacity_of
from diptych.simulate.workload import Workload, build
from engine.config import EngineConfig
from engine.sim.config import SimConfig
from planner import Limits, Planner, PoolLimits, SlaPolicy

PROFILE = "H200:Llama-3.1-8B"
VOCAB = 49152


def _phase(input_len: int, output_len: int, rate: float, n: int, start: float,
           seed: int) -> Workload:  # fmt: skip
    spec = WorkloadSpec(name="random", num_prompts=n, input_len=input_len,
                        output_len=output_len, range_ratio=0.1, seed=seed)  # fmt: skip
    w = build(spec, VOCAB, rate, burstiness=1.0, seed=seed)
    return Workload(w.requests, [None if t is None else t + start for t in w.send_at], {})


def _joined(*parts: Workload) -> Workload:
    reqs = [r for p in parts for r in p.requests]
    return Workload(reqs, [t for p in parts for t in p.send_at], {})


def test_prompt_heavy_grows_prefill_long_outputs_grow_decode_then_back_down() -> None:
    engine = EngineConfig(sim=SimConfig(profile=PROFILE, virtual=True), num_blocks=8192,
                          max_num_batched_tokens=4096)  # fmt: skip
    workload = _joined(
        _phase(200, 50, 2.0, 120, 0.0, 1),  # light
        _phase(6000, 50, 6.0, 720, 60.0, 2),  # prompt-heavy: 36k prompt tok/s
        _phase(200, 1500, 8.0, 960, 180.0, 3),  # long outputs: more streams than KV holds
    )
    fleet = Fleet(FleetConfig(engine, decode_workers=1, prefill_workers=1, startup_s=10.0),
                  workload)  # fmt: skip
    timing, layout = fleet.decode[0].runner.timing, fleet.decode[0].core.layout
    limits = Limits(PoolLimits(1, 8), PoolLimits(1, 8), budget=12, up_cooldown_s=10,
                    down_cooldown_s=30, idle_s=60)  # fmt: skip
    capacity = capacity_of(timing, 256, (layout.num_blocks - 1) * layout.block_size)
    sla = SlaPolicy(capacity, ttft_target_s=1.0, itl_target_s=0.03)
    planner = Planner(sla, limits, predictor="moving-average", window=2)
    planning = SimPlanning(planner, interval_s=10)
    planning.attach(fleet)
    m = fleet.run().metrics()
    assert m["completed"] == 1800 and m["failed"] == 0

    def peak(pool: str, t0: float, t1: float) -> int:
        return max(r.observation.ready_in(pool) for r in planning.ticks
                   if t0 <= r.observation.time < t1)  # fmt: skip

    assert peak("prefill", 30, 60) == peak("decode", 30, 60) == 1  # light: the minimum
    assert peak("prefill", 100, 180) > 1 and peak("decode", 100, 180) == 1  # prompts
    # outputs (prefill back to 1 once no tick in a down-cooldown asked for more)
    assert peak("decode", 250, 300) > 1 and peak("prefill", 250, 300) == 1
    last = planning.ticks[-1]
    assert {d.pool: d.target for d in last.decisions} == {"prefill": 1, "decode": 1}
    assert last.observation.ready == {"prefill": 1, "decode": 1}
    assert all(w.core.is_idle() for w in fleet.decode + fleet.prefill + fleet.retired)
    assert fleet.accelerator_s() < 12 * fleet.now  # under the budget's ceiling
