"""The simulated engine: the real scheduler and KV cache around a timing model, with
deterministic tokens, real KV writes of a scaled size and dilated time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig, SamplingParams
from engine.engine_core import EngineCore
from engine.request import NewRequest
from engine.sim.config import SimConfig
from engine.sim.runner import SimModelRunner
from engine.sim.timing import Grid, ProfileTiming, load_timing, parse_roofline
from engine.sim.tokens import natural_length, prompt_key, token_at

H200_70B = "H200:Llama-3.1-70B:tp8"


def _core(profile: str = H200_70B, **sim: object) -> EngineCore:
    speedup = sim.pop("speedup", 1e9)  # no waiting in unit tests unless asked
    cfg = SimConfig(profile=profile, speedup=speedup, **sim)  # type: ignore[arg-type]
    return EngineCore(EngineConfig(sim=cfg, num_blocks=sim.get("num_blocks", 512)))  # type: ignore[arg-type]


def _run(core: EngineCore, reqs: dict[str, list[int]], **params: object) -> dict[str, list[int]]:
    for rid, prompt in reqs.items():
        core.submit(NewRequest(rid, prompt, SamplingParams(**params)))  # type: ignore[arg-type]
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return out


PROMPTS = {f"r{i}": [1 + (i * 7 + j) % 900 for j in range(20 + 37 * i)] for i in range(6)}


def test_tokens_are_a_function_of_the_prompt_and_position_only() -> None:
    alone = {rid: _run(_core(), {rid: p}, max_tokens=24)[rid] for rid, p in PROMPTS.items()}
    together = _run(_core(), PROMPTS, max_tokens=24)
    assert together == alone
    assert len({tuple(v) for v in alone.values()}) == len(alone)
    vocab = _core().model_config.vocab_size
    assert all(0 <= t < vocab for v in alone.values() for t in v)


def test_a_seed_changes_sampled_text_and_greedy_ignores_it() -> None:
    p = {"a": PROMPTS["r2"]}
    greedy = _run(_core(), p, max_tokens=16, temperature=0.0)
    assert _run(_core(), p, max_tokens=16, temperature=0.0, seed=5) == greedy
    s5 = _run(_core(), p, max_tokens=16, temperature=1.0, seed=5)
    assert s5 == _run(_core(), p, max_tokens=16, temperature=1.0, seed=5)
    assert s5 != _run(_core(), p, max_tokens=16, temperature=1.0, seed=6)


def test_replies_end_at_eos_with_the_stated_mean_length_unless_eos_is_ignored() -> None:
    lengths = [natural_length(prompt_key([i, i + 1, i + 2]), 50) for i in range(2000)]
    assert 45 < sum(lengths) / len(lengths) < 55 and min(lengths) >= 1  # type: ignore[arg-type]
    key = prompt_key([1, 2, 3])
    n = natural_length(key, 50)
    assert n is not None and natural_length(key, 0) is None
    reply = [token_at(key, 3 + i, i, 1000, (7,), 50) for i in range(n + 5)]
    assert reply.index(7) == n - 1 and reply.count(7) == 1
    core = _core(mean_output_tokens=4)
    ended = _run(core, PROMPTS, max_tokens=200)
    assert all(len(v) < 200 for v in ended.values())
    assert all(len(v) == 200 for v in _run(_core(mean_output_tokens=4), PROMPTS,
                                            max_tokens=200, ignore_eos=True).values())  # fmt: skip


def test_kv_bytes_are_the_devices_scaled_and_every_computed_token_is_written() -> None:
    timing = parse_roofline(H200_70B)
    assert timing.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # 8 KV heads over 8 GPUs
    core = _core(kv_scale=1 / 256)
    assert core.layout.block_bytes / core.layout.block_size == pytest.approx(
        timing.kv_bytes_per_token / 256, rel=0.05
    )
    assert core.layout.model.startswith("sim:") and core.layout.layout_hash
    prompts = {"a": list(range(1, 41)), "b": list(range(300, 337))}
    replies: dict[str, list[int]] = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():  # two requests share each decode step
        core.submit(NewRequest(rid, prompt, SamplingParams(max_tokens=6, ignore_eos=True),
                               hold_blocks=True))  # fmt: skip
    while core.has_unfinished_requests():
        for out in core.step():
            replies[out.request_id] += out.new_token_ids
    pool = core.runner.kv_pool
    for rid, prompt in prompts.items():
        # the prompt, and every sampled token but the last (its KV is never computed)
        tokens = prompt + replies[rid][:-1]
        written = pool[core.block_ids(rid), 0, 0, :, 0, 0].reshape(-1)[: len(tokens)].tolist()
        assert written == [float(t % 251) for t in tokens]
        core.release_held(rid)
    assert core.is_idle() and not core.check_invariants()


def test_the_device_capacity_sets_the_block_count() -> None:
    core = EngineCore(EngineConfig(sim=SimConfig(profile=H200_70B), block_size=16))
    cap = parse_roofline(H200_70B).kv_capacity_tokens()
    assert core.layout.num_blocks == 1 + cap // 16
    assert 2e6 < cap < 3e6  # ~124 GB free of 141 GB, 40 KB per token


def test_a_remote_prefill_continues_exactly_as_a_local_one() -> None:
    prompt = PROMPTS["r4"]
    local = _run(_core(), {"x": prompt}, max_tokens=12)["x"]
    prefill, decode = _core(), _core()
    prefill.submit(NewRequest("x", prompt, SamplingParams(max_tokens=1), hold_blocks=True))
    first = [t for o in prefill.step() for t in o.new_token_ids]
    plan = decode.submit(NewRequest("x", prompt, SamplingParams(max_tokens=12)),
                         remote_min_uncached=1)  # fmt: skip
    assert plan is not None
    src, dst = prefill.runner.kv_pool, decode.runner.kv_pool
    for s, d in zip(prefill.block_ids("x"), plan.block_ids, strict=False):
        dst[d].copy_(src[s])  # what the transfer layer does between two pools
    prefill.release_held("x")
    out = decode.remote_kv_ready("x", first[0]).new_token_ids
    while decode.has_unfinished_requests():
        out += [t for o in decode.step() for t in o.new_token_ids]
    assert out == local
    assert prefill.is_idle() and decode.is_idle()


def test_a_step_sleeps_its_simulated_time_over_the_speedup() -> None:
    now = [0.0]
    slept: list[float] = []
    core = _core(speedup=10.0)

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    runner = core.runner
    assert isinstance(runner, SimModelRunner)
    runner._clock, runner._sleep = (lambda: now[0]), sleep
    core.submit(NewRequest("a", list(range(1, 2001)), SamplingParams(max_tokens=3)))
    while core.has_unfinished_requests():
        core.step()
    timing = parse_roofline(H200_70B)
    expected = timing.step_s([(2000, 0)]) + timing.step_s([(1, 2000)]) + timing.step_s([(1, 2001)])
    assert sum(slept) == pytest.approx(runner.busy_s / 10.0)
    # each step drawn around the roofline's time (log-normal, sigma 1.7 %)
    assert runner.busy_s == pytest.approx(expected, rel=0.08)
    assert runner.busy_s != expected


def _profile(tmp_path: Path, **extra: Any) -> Path:
    doc = {
        "kind": "diptych-profile",
        "version": 1,
        "name": "toy",
        "model": EngineCore(EngineConfig(sim=SimConfig())).model_config.to_dict(),
        "kv_bytes_per_token": 1024,
        "kv_capacity_tokens": 100_000,
        "prefill": {"new_tokens": [16, 256, 1024], "cached_tokens": [0, 512],
                    "seconds": [[0.02, 0.03], [0.1, 0.15], [0.4, 0.6]]},
        "decode": {"batch": [1, 8], "context": [128, 1024],
                   "seconds": [[0.01, 0.012], [0.02, 0.03]]},
        **extra,
    }  # fmt: skip
    path = tmp_path / "toy.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_measured_profile_interpolates_and_prices_a_mixed_step(tmp_path: Path) -> None:
    timing = load_timing(str(_profile(tmp_path)))
    assert isinstance(timing, ProfileTiming)
    assert timing.step_s([(256, 0)]) == pytest.approx(0.1)
    assert timing.step_s([(640, 0)]) == pytest.approx(0.25)  # halfway 256..1024
    assert timing.step_s([(256, 256)]) == pytest.approx(0.125)
    assert timing.step_s([(2048, 0)]) == pytest.approx(0.8)  # the last segment, extended
    assert timing.step_s([(1, 128)] * 8) == pytest.approx(0.02)
    # one pass pays the fixed cost (the smallest prompt's) once
    assert timing.step_s([(256, 0), (1, 128)]) == pytest.approx(0.01 + 0.1 - 0.02)
    assert timing.step_s([(256, 0), (256, 0)]) == pytest.approx(0.1 + 0.1 - 0.02)
    core = _core(profile=str(_profile(tmp_path)))
    assert core.layout.num_blocks == 512 and "toy" in core.runner.kernel_summary()


def test_a_measured_mixed_grid_prices_prefill_chunks_that_join_decodes(tmp_path: Path) -> None:
    mixed = {"new_tokens": [64, 256], "batch": [1, 8],
             "extra_seconds": [[0.02, 0.03], [0.08, 0.1]]}  # fmt: skip
    timing = load_timing(str(_profile(tmp_path, mixed=mixed)))
    decode8 = timing.step_s([(1, 128)] * 8)
    assert timing.step_s([(256, 0)] + [(1, 128)] * 8) == pytest.approx(decode8 + 0.1)
    assert timing.step_s([(256, 0), (1, 128)]) == pytest.approx(0.01 + 0.08)
    # a cached prefix adds what it adds to a lone prefill of that size
    assert timing.step_s([(256, 512), (1, 128)]) == pytest.approx(0.01 + 0.08 + 0.05)
    assert timing.step_s([(256, 0)]) == pytest.approx(0.1)  # no decodes: the prefill grid


def test_instant_and_fixed_steps() -> None:
    assert load_timing("instant").step_s([(1, 10)] * 64) == 0.0
    fixed = load_timing("fixed:2.5ms")
    assert fixed.name == "fixed:2.5ms" and fixed.step_s([(512, 0), (1, 9)]) == 0.0025


def test_bad_specs_and_grids_say_what_is_wrong() -> None:
    for spec in ("fixed:5", "fixed:0ms", "fixed:fastms"):
        with pytest.raises(ValueError, match="fixed:<milliseconds>ms"):
            load_timing(spec)
    with pytest.raises(ValueError, match="ACCELERATOR:MODEL"):
        load_timing("B200:Llama-3.1-70B")
    with pytest.raises(ValueError, match="tensor_parallel"):
        load_timing("H200:Llama-3.1-70B:tp3")
    with pytest.raises(ValueError, match="over the"):
        load_timing("L40S:Llama-3.1-70B")  # 141 GB of weights on a 48 GB card
    with pytest.raises(ValueError, match="increasing"):
        Grid((1.0, 1.0), (0.0,), ((1.0,), (2.0,)))
    with pytest.raises(ValueError, match="kv_scale"):
        SimConfig(kv_scale=0)


def test_step_times_jitter_as_measured_and_repeat_exactly() -> None:
    """A step's time is drawn log-normal around the roofline's: p99 over p50 about
    1.04, as vLLM's per-token ITL of Llama-3.1-70B FP8 on one H100 (32.53 / 33.83 ms);
    two runners draw the same sequence, so a simulation repeats."""
    a, b = _core().runner, _core().runner
    assert isinstance(a, SimModelRunner) and isinstance(b, SimModelRunner)
    draws = sorted(a._jitter_factor() for _ in range(20_000))
    p50, p99 = draws[10_000], draws[19_800]
    assert p99 / p50 == pytest.approx(33.83 / 32.53, rel=0.01)
    again = sorted(b._jitter_factor() for _ in range(20_000))
    assert again == draws
