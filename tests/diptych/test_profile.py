"""`diptych profile`: a real engine's step times, measured into a profile the simulated
engine then reproduces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diptych.cli import main
from engine import EngineConfig, SamplingParams
from engine.engine_core import EngineCore
from engine.request import NewRequest
from engine.sim.config import SimConfig
from engine.sim.timing import ProfileTiming, load_timing


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "cpu.json"
    rc = main(["profile", "--output", str(out), "--prefill-tokens", "16,128",
               "--cached-tokens", "0,128", "--batch-sizes", "1,4", "--contexts", "64,192",
               "--mixed-tokens", "32,128", "--mixed-batches", "1,2",
               "--repeats", "1", "--num-blocks", "256"])  # fmt: skip
    assert rc == 0
    return out


def test_the_profile_holds_both_grids_the_model_and_the_machine(profile_path: Path) -> None:
    doc = json.loads(profile_path.read_text())
    assert doc["kind"] == "diptych-profile" and doc["machine"]["cpu"]
    assert doc["model"]["name"].startswith("SmolLM2")
    assert doc["kv_capacity_tokens"] == 255 * 16
    pre = doc["prefill"]["seconds"]
    assert all(t > 0 for row in pre for t in row)
    assert pre[1][0] > pre[0][0]  # 128 new tokens cost more than 16
    dec = doc["decode"]["seconds"]
    assert all(t > 0 for row in dec for t in row)
    mixed = doc["mixed"]
    assert (mixed["new_tokens"], mixed["batch"]) == ([32, 128], [1, 2])
    assert all(t >= 0 for row in mixed["extra_seconds"] for t in row)
    assert max(mixed["extra_seconds"][1]) > 0  # 128 more prompt tokens cost something
    assert profile_path.with_suffix(".png").stat().st_size > 10_000


def test_the_simulated_engine_replays_the_measured_times(profile_path: Path) -> None:
    timing = load_timing(str(profile_path))
    assert isinstance(timing, ProfileTiming)
    doc = json.loads(profile_path.read_text())
    assert timing.step_s([(128, 0)]) == pytest.approx(doc["prefill"]["seconds"][1][0])
    assert timing.step_s([(1, 192)] * 4) == pytest.approx(doc["decode"]["seconds"][1][1])
    joined = timing.step_s([(128, 0), (1, 64), (1, 64)])
    assert joined == pytest.approx(
        doc["decode"]["seconds"][1][0] / 3 + doc["decode"]["seconds"][0][0] * 2 / 3
        + doc["mixed"]["extra_seconds"][1][1]
    )  # fmt: skip
    sim = SimConfig(profile=str(profile_path), speedup=1e9)
    core = EngineCore(EngineConfig(sim=sim))
    assert core.layout.num_blocks == 256  # the profiled engine's pool
    assert core.model_config.num_hidden_layers == doc["model"]["num_hidden_layers"]
    core.submit(NewRequest("a", list(range(100, 228)), SamplingParams(max_tokens=2)))
    while core.has_unfinished_requests():
        core.step()
    expected = timing.step_s([(128, 0)]) + timing.step_s([(1, 128)])
    assert core.runner.busy_s == pytest.approx(expected)  # type: ignore[union-attr]


def test_profile_refuses_a_simulated_engine(tmp_path: Path) -> None:
    rc = main(["profile", "--engine", "sim", "--output", str(tmp_path / "x.json")])
    assert rc == 2
