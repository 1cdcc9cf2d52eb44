"""`diptych simulate`: the fleet simulator in virtual time, over real engine cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.workloads import WorkloadSpec
from diptych.cli import main
from diptych.simulate.fleet import Fleet, FleetConfig
from diptych.simulate.workload import IdPromptBuilder, build, token_ids
from engine.config import EngineConfig
from engine.sim.config import SimConfig
from engine.sim.roofline import Roofline, accelerators, models

PROFILE = "H200:Llama-3.1-70B:tp8"
VOCAB = 49152


def _fleet(prefill: int, decode: int, spec: WorkloadSpec, rate: float, **kw: object) -> Fleet:
    engine = EngineConfig(sim=SimConfig(profile=PROFILE, virtual=True), num_blocks=4096,
                          max_num_batched_tokens=4096)  # fmt: skip
    cfg = FleetConfig(engine, decode_workers=decode, prefill_workers=prefill, **kw)  # type: ignore[arg-type]
    return Fleet(cfg, build(spec, VOCAB, rate, burstiness=0.5, seed=spec.seed))


SHAREGPT = WorkloadSpec(name="sharegpt", num_prompts=300, seed=3)


def test_token_ids_survive_the_text_round_trip() -> None:
    import random

    builder = IdPromptBuilder(VOCAB)
    text = builder.text(5000, random.Random(0))
    ids = token_ids(text)
    assert len(ids) == 5000 and all(64 <= i < VOCAB for i in ids)
    assert token_ids(builder.concat(text[:10], text[10:20])) == ids[:20]


def test_a_run_is_deterministic_and_returns_every_block() -> None:
    a = _fleet(1, 2, SHAREGPT, 20.0)
    b = _fleet(1, 2, SHAREGPT, 20.0)
    ma, mb = a.run().metrics(), b.run().metrics()
    assert ma == mb
    assert ma["completed"] == 300 and ma["failed"] == 0
    assert all(w.core.is_idle() and not w.core.check_invariants() for w in a.decode + a.prefill)
    other = _fleet(1, 2, WorkloadSpec(name="sharegpt", num_prompts=300, seed=4), 20.0)
    assert other.run().metrics() != ma


def test_runs_of_decode_steps_match_stepping_one_at_a_time() -> None:
    fast = _fleet(1, 1, SHAREGPT, 8.0)
    slow = _fleet(1, 1, SHAREGPT, 8.0, fast_forward=False)
    mf, ms = fast.run().metrics(), slow.run().metrics()
    assert mf["total_output_tokens"] == ms["total_output_tokens"]
    for key in ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p90_tpot_ms", "mean_e2el_ms"):
        assert mf[key] == pytest.approx(ms[key], rel=0.02), key
    assert mf["p99_itl_ms"] == pytest.approx(ms["p99_itl_ms"], rel=0.05)
    busy_fast = sum(w.busy_s for w in fast.decode)
    assert busy_fast == pytest.approx(sum(w.busy_s for w in slow.decode), rel=0.02)


def test_disaggregated_prefill_runs_on_prefill_workers_and_aggregated_does_not() -> None:
    spec = WorkloadSpec(name="bursty", num_prompts=200, seed=1, short_input_len=200,
                        short_output_len=100, long_input_len=6000, long_output_len=50,
                        long_every=10)  # fmt: skip
    disagg = _fleet(2, 2, spec, 10.0)
    rec = disagg.run()
    assert all(w.busy_s > 0 for w in disagg.prefill)
    agg = _fleet(0, 2, spec, 10.0)
    agg_rec = agg.run()
    assert rec.metrics()["completed"] == agg_rec.metrics()["completed"] == 200
    # the decode workers of the split never compute a long prompt: no token waits for one
    split, mixed = rec.metrics((100,)), agg_rec.metrics((100,))
    assert split["p100_itl_ms"] < 20 < 100 < mixed["p100_itl_ms"]
    for fleet in (disagg, agg):
        assert all(w.core.is_idle() for w in fleet.decode + fleet.prefill)


def test_step_times_are_the_rooflines() -> None:
    spec = WorkloadSpec(name="random", num_prompts=1, seed=0, input_len=1000, output_len=101,
                        range_ratio=0.0)  # fmt: skip
    fleet = _fleet(0, 1, spec, 1.0)
    rec = fleet.run()
    m = rec.metrics()
    r = Roofline(accelerators()["H200"], models()["Llama-3.1-70B"], tensor_parallel=8)
    # one step, drawn around the roofline's time (log-normal, sigma 1.7 %)
    assert m["mean_ttft_ms"] == pytest.approx(1e3 * r.prefill_s(1000), rel=0.08)
    # 100 decode steps from context 1000 to 1099, priced at their middle (one run: one
    # jitter draw for all of them)
    assert m["mean_tpot_ms"] == pytest.approx(1e3 * r.decode_step_s(1, 1050), rel=0.08)


def test_sessions_wait_for_their_previous_turn() -> None:
    spec = WorkloadSpec(name="multiturn", num_prompts=12, seed=0, turns=3, system_len=100,
                        num_systems=1, user_len=40, turn_output_len=20, think_time=2.0)  # fmt: skip
    fleet = _fleet(0, 2, spec, 2.0)
    rec = fleet.run()
    assert len(rec.done) == 12
    hit = sum(w.core.scheduler.prefix_hit_tokens for w in fleet.decode)
    assert hit > 0  # later turns find their history cached


def test_the_command_writes_the_report_json_and_plots(tmp_path: Path) -> None:
    rc = main(["simulate", "--profile", PROFILE, "--prefill-workers", "1", "--decode-workers",
               "2", "--dataset-name", "sharegpt", "--num-prompts", "100", "--request-rate",
               "5,inf", "--goodput", "ttft:500", "tpot:50", "--result-dir", str(tmp_path),
               "--num-blocks", "4096"])  # fmt: skip
    assert rc == 0
    doc = json.loads((tmp_path / "simulate-1P2D-5.0.json").read_text())
    assert doc["completed"] == 100 and doc["kv_leaks"] == [] and doc["timeline"]
    assert doc["request_goodput"] is not None and doc["model_id"].startswith("sim:H200")
    assert (tmp_path / "simulate-1P2D-5.0.png").stat().st_size > 10_000
    assert (tmp_path / "simulate-1P2D-sweep.png").exists()


def test_a_mooncake_trace_drives_the_fleet_and_shared_ids_share_a_prefix(tmp_path: Path) -> None:
    from diptych.simulate.workload import from_trace

    rows = [{"timestamp": 100 * i, "input_length": 1100, "output_length": 8,
             "hash_ids": [7, 8, 100 + i]} for i in range(6)]  # fmt: skip
    rows.append({"timestamp": 700, "input_length": 40, "output_length": 3})
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    wl = from_trace(path, VOCAB)
    assert wl.send_at == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7]
    a, b = token_ids(wl.requests[0].prompt), token_ids(wl.requests[1].prompt)
    assert len(a) == len(b) == 1100 and a[:1024] == b[:1024] and a[1024:] != b[1024:]
    engine = EngineConfig(sim=SimConfig(profile=PROFILE, virtual=True), num_blocks=4096)
    fleet = Fleet(FleetConfig(engine, decode_workers=1), wl)
    rec = fleet.run()
    assert len(rec.done) == 7 and fleet.decode[0].core.scheduler.prefix_hit_tokens >= 5 * 1024
    path.write_text('{"timestamp": 1, "input_length": 0, "output_length": 3}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:1"):
        from_trace(path, VOCAB)


def test_scaling_mid_run_adds_ready_workers_later_and_drains_the_going_ones() -> None:
    fleet = _fleet(2, 2, SHAREGPT, 20.0, startup_s=5.0)
    fleet.at(2.0, lambda: fleet.scale("decode", 4))
    fleet.at(3.0, lambda: (fleet.scale("prefill", 3), fleet.scale("prefill", 1)))
    seen: dict[str, object] = {}

    def look() -> None:
        seen["starting"] = dict(fleet.starting)
        seen["live"] = {p: len(fleet.live(p)) for p in ("decode", "prefill")}

    fleet.at(4.0, look)
    fleet.at(8.0, lambda: seen.update(at8=len(fleet.live("decode"))))
    fleet.at(9.0, lambda: fleet.scale("prefill", 0))  # queued prompts go local
    fleet.at(10.0, lambda: fleet.scale("decode", 1))
    m = fleet.run().metrics()
    assert m["completed"] == 300 and m["failed"] == 0  # no request lost to a scale-down
    assert seen["starting"] == {"decode": 2, "prefill": 0}  # the prefill start taken back
    assert seen["live"] == {"decode": 2, "prefill": 1}
    assert seen["at8"] == 4
    assert len(fleet.decode) == 1 and not fleet.prefill and not fleet.draining
    everyone = fleet.decode + fleet.retired
    assert len(everyone) == 6 and all(w.core.is_idle() for w in everyone)  # 4 decode, 2 prefill
    # paid: 2 decode + 2 prefill from 0, 2 decode from 2 s, one taken-back start 3-8 s
    assert 2 * fleet.now < fleet.accelerator_s() < 6 * fleet.now
    with pytest.raises(ValueError, match="decode needs at least one"):
        fleet.scale("decode", 0)


def test_the_command_writes_nothing_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    rc = main(["simulate", "--profile", PROFILE, "--decode-workers", "1", "--num-prompts", "4",
               "--random-input-len", "64", "--random-output-len", "8"])  # fmt: skip
    assert rc == 0 and "simulated" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_each_pool_runs_its_own_tensor_parallel_size() -> None:
    """A roofline without a size: prefill workers at --prefill-accelerators' TP, decode
    workers at --decode-accelerators'; their step times are those rooflines'."""
    from diptych.cli import build_parser
    from diptych.simulate.cli import fleet_config

    args = build_parser().parse_args([
        "simulate", "--profile", "H200:Llama-3.1-70B", "--prefill-workers", "1",
        "--decode-workers", "1", "--prefill-accelerators", "2", "--decode-accelerators", "8",
    ])  # fmt: skip
    cfg = fleet_config(args, ignore_eos=True)
    spec = WorkloadSpec(name="random", num_prompts=1, seed=0, input_len=1000, output_len=11,
                        range_ratio=0.0)  # fmt: skip
    fleet = Fleet(cfg, build(spec, VOCAB, 1.0, burstiness=0.5, seed=0))
    prefill, decode = fleet.prefill[0].runner.timing, fleet.decode[0].runner.timing
    assert isinstance(prefill, Roofline) and isinstance(decode, Roofline)
    assert (prefill.tensor_parallel, decode.tensor_parallel) == (2, 8)
    assert fleet.run().metrics()["completed"] == 1
    same = fleet_config(build_parser().parse_args(
        ["simulate", "--profile", PROFILE, "--prefill-accelerators", "2"]), ignore_eos=True)
    assert same.prefill_engine is None  # a profile that names its size keeps it


def test_a_reasoning_workload_keeps_its_budgets() -> None:
    """Thinking budgets hold through runs of fast-forwarded decode steps (as stepping
    one at a time), and TTFA and the thinking rate are reported."""
    spec = WorkloadSpec(name="reasoning", num_prompts=60, seed=5, low_thinking=32,
                        high_thinking=600, answer_len=16, high_every=3)  # fmt: skip
    fast = _fleet(0, 1, spec, 4.0)
    result = fast.run()
    m = result.metrics()
    assert m["completed"] == 60
    budget = {"low": 32, "high": 600}
    # at most the budget and the end marker (a stop token inside ends thinking early)
    assert all(0 < (r.reasoning_tokens or 0) <= budget[r.tag] + 1 for r in result.done)
    assert sum(r.reasoning_tokens == budget[r.tag] + 1 for r in result.done) > 30
    assert m["median_ttfa_ms"] > m["median_ttft_ms"] and m["reasoning_throughput"] > 0
    slow = _fleet(0, 1, spec, 4.0, fast_forward=False).run().metrics()
    assert slow["total_reasoning_tokens"] == m["total_reasoning_tokens"]
    assert slow["total_output_tokens"] == m["total_output_tokens"]
