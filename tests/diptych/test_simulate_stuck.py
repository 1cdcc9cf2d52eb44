"""The fleet simulator's watchdog: a run that cannot finish ends with `SimulationStuck`,
naming the workers and requests involved, instead of spinning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.workloads import WorkloadSpec
from diptych.cli import main
from diptych.simulate.fleet import Fleet, FleetConfig, SimulationStuck
from diptych.simulate.worker import SimWorker
from diptych.simulate.workload import build
from engine.config import EngineConfig
from engine.sim.config import SimConfig

VOCAB = 49152
TINY = WorkloadSpec(name="random", num_prompts=2, seed=0, input_len=64, output_len=8)


def _fleet(prefill: int, spec: WorkloadSpec, profile: str, num_blocks: int, **kw: object) -> Fleet:
    engine = EngineConfig(sim=SimConfig(profile=profile, virtual=True), num_blocks=num_blocks)
    cfg = FleetConfig(engine, decode_workers=1, prefill_workers=prefill, **kw)  # type: ignore[arg-type]
    return Fleet(cfg, build(spec, VOCAB, float("inf"), burstiness=1.0, seed=spec.seed))


def _spins_in_place(w: SimWorker) -> None:
    """`w` takes steps that run nothing and take no simulated time, forever."""

    def start(now: float) -> float:
        w.busy_until = now
        w.version += 1
        return now

    w.start = start  # type: ignore[method-assign]


def test_a_worker_whose_steps_take_no_time_is_named_with_its_requests() -> None:
    fleet = _fleet(0, TINY, "H200:Llama-3.1-70B:tp8", 512, watchdog_steps=50)
    _spins_in_place(fleet.decode[0])
    with pytest.raises(SimulationStuck) as stuck:
        fleet.run()
    msg = str(stuck.value)
    assert msg.startswith("the simulation is stuck at t=0.000000 s: decode-0 took 50 steps")
    assert "virtual time stands still" in msg
    assert "decode-0: running [], waiting [r0, r1]" in msg
    assert "open requests: [r0, r1]" in msg


def test_open_requests_with_nothing_left_to_happen_are_named() -> None:
    fleet = _fleet(0, TINY, "H200:Llama-3.1-70B:tp8", 512)
    w = fleet.decode[0]
    w.start = lambda now: None  # type: ignore[method-assign]  # never runs what it holds
    with pytest.raises(SimulationStuck) as stuck:
        fleet.run()
    msg = str(stuck.value)
    assert "2 request(s) are open but nothing is left to happen" in msg
    assert "decode-0: running [], waiting [r0, r1]" in msg


def test_the_watchdog_lets_a_healthy_run_finish() -> None:
    fleet = _fleet(1, TINY, "H200:Llama-3.1-70B:tp8", 512, watchdog_steps=1)
    assert fleet.run().metrics()["completed"] == 2
    with pytest.raises(ValueError, match="watchdog_steps"):
        _fleet(0, TINY, "H200:Llama-3.1-70B:tp8", 512, watchdog_steps=0)


def test_the_issue_36_command_finishes_while_remote_prefills_pin_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """1 prefill + 1 decode worker, 500 KV blocks, 8 random 1024-token prompts at rate
    inf. At t=0 seven remote prefills pin 448 of the decode worker's 499 blocks and the
    eighth prompt, prefilled locally, cannot get its 64: the decode worker's step runs
    nothing. It was taken as a step of 0 s and the worker kicked again at the same
    instant, forever; it now waits for the first KV to land."""
    monkeypatch.chdir(tmp_path)
    rc = main(["simulate", "--profile", "H200:Llama-3.1-70B:tp1:float8", "--num-blocks", "500",
               "--num-prompts", "8"])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0, out.err  # every request done, no KV left behind
    assert re.search(r"Successful requests:\s+8\s", out.out)


def test_kv_adopted_behind_a_preempted_request_is_taken_back_when_nothing_runs() -> None:
    """2 random 1024-token prompts, both prefilled remotely, into 129 decode blocks: the
    first to land runs, the second waits holding its 64 blocks; the first then needs a
    block, preempts itself and cannot come back beside the second's. Nothing ran and
    nothing was left to happen: the second now gives its blocks back."""
    spec = WorkloadSpec(name="random", num_prompts=2, seed=0, input_len=1024, output_len=128)
    fleet = _fleet(1, spec, "H200:Llama-3.1-70B:tp1:float8", 130)
    assert fleet.run().metrics()["completed"] == 2
    decode = fleet.decode[0].core
    assert decode.is_idle() and not decode.check_invariants()
    assert decode.scheduler.num_preemptions >= 2
