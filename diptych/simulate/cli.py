"""`diptych simulate`: a `diptych bench` workload through a simulated fleet, in virtual time.

    diptych simulate --profile H200:Llama-3.1-70B:tp8 --prefill-workers 4 \\
        --decode-workers 12 --dataset-name sharegpt --num-prompts 2000 \\
        --request-rate 2,4,8 --goodput ttft:1000 tpot:50

The workload flags are `diptych bench`'s (so are the report, the JSON and the sweep
plot); the fleet flags say what runs it. Each rate gets a fresh fleet. With
`--result-dir DIR` it writes there, per rate, the `vllm bench serve`-style JSON with
the timeline in it and a timeline PNG (and the sweep plot, or at `--plot`); without
it, nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.cli import config_from_args
from bench.config import BenchConfig
from bench.plot import plot_sweep
from bench.report import format_result, format_sweep
from decode_worker.config import DecodeWorkerConfig
from diptych.flags import build, construct, flag_value, given
from diptych.json_types import JsonObject
from diptych.planner_options import plan_settings
from diptych.serve_options import ServeOptions
from diptych.simulate.fleet import IB_EFFICIENCY, Fleet, FleetConfig, SimulationStuck
from diptych.simulate.options import DECODE_FLAGS, add_arguments
from diptych.simulate.planning import SimPlanning, capacity_of
from diptych.simulate.results import Recorder
from diptych.simulate.routing import RoutingConfig, routing_summary
from diptych.simulate.timeline import plot_timeline
from diptych.simulate.workload import Workload, from_trace
from diptych.simulate.workload import build as build_workload
from engine.config import EngineConfig
from engine.sim.config import SimConfig
from engine.sim.timing import at_tensor_parallel
from frontend.config import KvRouterConfig
from planner.capacity import CapacityModel, PoolCapacity
from prefill_worker.config import PrefillWorkerConfig


def fleet_config(args: argparse.Namespace, ignore_eos: bool) -> FleetConfig:
    """The fleet the flags describe. A roofline profile that names no tensor-parallel
    size runs each pool at its own (`--prefill-accelerators`, `--decode-accelerators`:
    a worker's accelerators are its ranks)."""
    sizes = plan_settings(args).accelerators()
    sim = build(SimConfig, args, virtual=True)
    engines = {
        pool: build(EngineConfig, args, sim=dataclasses.replace(
            sim, profile=at_tensor_parallel(sim.profile, sizes[pool])))
        for pool in ("prefill", "decode")
    }  # fmt: skip
    decode = given(DecodeWorkerConfig, args)
    serve = build(ServeOptions, args)
    return construct(
        FleetConfig,
        {k: decode[k] for k in DECODE_FLAGS if k in decode},
        engine=engines["decode"],
        prefill_engine=engines["prefill"] if engines["prefill"] != engines["decode"] else None,
        decode_workers=serve.decode_workers,
        prefill_workers=serve.prefill_workers,
        max_batch=flag_value(args, PrefillWorkerConfig, "max_batch"),
        transfer_bytes_per_s=args.transfer_gbps * 1e9 / 8 * IB_EFFICIENCY,
        ignore_eos=ignore_eos,
        startup_s=args.startup,
        routing=RoutingConfig(
            router=args.router,
            frontends=args.frontends,
            event_latency_s=args.event_latency_ms / 1000,
            kv=build(KvRouterConfig, args),
        ),
    )


def simulate_rate(
    bench: BenchConfig,
    fleet: FleetConfig,
    rate: float,
    index: int,
    workload: Workload | None = None,
    planner_args: argparse.Namespace | None = None,
) -> tuple[JsonObject, Recorder]:
    """One run: the document `diptych bench` would write for it, and the recorder;
    `workload` (a trace) replaces the bench workload at `rate`; `planner_args` (the
    planner flags, with `.planner` set) scale the fleet while it runs."""
    own = workload is None  # built here for this run: its prompts can go once sent
    if workload is None:
        workload = build_workload(
            bench.workload, _vocab(fleet), rate, bench.burstiness, bench.seed + index
        )
    started = time.perf_counter()
    sim = Fleet(fleet, workload, drop_prompts=own)
    planning = None
    if planner_args is not None and planner_args.planner:
        layout = sim.decode[0].core.layout
        kv_tokens = (layout.num_blocks - 1) * layout.block_size
        capacity: CapacityModel = capacity_of(
            sim.decode[0].runner.timing, fleet.engine.max_num_seqs, kv_tokens
        )
        if sim.prefill and fleet.prefill_engine is not None:  # priced at its own size
            prefill = capacity_of(sim.prefill[0].runner.timing, fleet.engine.max_num_seqs,
                                  kv_tokens)  # fmt: skip
            capacity = PoolCapacity(prefill, capacity)
        settings = plan_settings(planner_args)
        planning = SimPlanning(settings.planner(capacity), settings.interval_s)
        planning.attach(sim)
    recorder = sim.run()
    wall = time.perf_counter() - started
    leaks = [w.name for w in sim.decode + sim.prefill + sim.retired if not w.core.is_idle()]
    doc: JsonObject = {
        "backend": "diptych-simulate",
        "label": bench.label,
        "model_id": sim.decode[0].core.model_config.name,
        "profile": fleet.engine.sim.profile if fleet.engine.sim else "",
        "num_prompts": len(workload.requests),
        "request_rate": rate if not math.isinf(rate) else "inf",
        "burstiness": bench.burstiness,
        "dataset_name": bench.workload.name,
        "seed": bench.seed,
        "ignore_eos": fleet.ignore_eos,
        "goodput_config": dict(bench.goodput) or None,
        "prefill_workers": fleet.prefill_workers,
        "decode_workers": fleet.decode_workers,
        "wall_s": wall,
        "kv_leaks": leaks,
        "accelerator_hours": sim.accelerator_s(
            plan_settings(planner_args).accelerators() if planner_args is not None else None
        ) / 3600,
        **recorder.metrics(bench.percentiles, bench.goodput),
        "routing": {"router": fleet.routing.router, "frontends": fleet.routing.frontends,
                    **routing_summary(sim)},
    }  # fmt: skip
    if planning is not None:
        doc["planner"] = [
            {"t": r.observation.time, "rate": r.observation.request_rate,
             "predicted_rate": r.forecast.request_rate, "ready": r.observation.ready,
             "target": {d.pool: d.target for d in r.decisions},
             "reasons": {d.pool: d.reason for d in r.decisions if d.changed}}
            for r in planning.ticks
        ]  # fmt: skip
    tags = recorder.per_tag(bench.percentiles)
    if len(tags) > 1:
        doc["per_tag"] = tags
    doc["busy"] = {w.name: w.busy_s / max(recorder.end, 1e-9) for w in sim.decode + sim.prefill}
    doc["timeline"] = recorder.timeline
    return doc, recorder


def _vocab(fleet: FleetConfig) -> int:
    from engine.weights import load_model_config, resolve_model

    return load_model_config(resolve_model(fleet.engine.model)).vocab_size


def run(args: argparse.Namespace) -> int:
    bench = config_from_args(args)
    fleet = fleet_config(args, bench.ignore_eos)
    if args.timeline_every:
        fleet = dataclasses.replace(fleet, sample_every_s=args.timeline_every)
    out_dir = Path(bench.result_dir) if bench.result_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    mode = (
        f"{fleet.prefill_workers}P{fleet.decode_workers}D"
        if fleet.prefill_workers
        else f"{fleet.decode_workers} aggregated"
    )
    rows = []
    trace = from_trace(args.trace, _vocab(fleet), args.trace_block_tokens) if args.trace else None
    for i, rate in enumerate([math.nan] if trace else bench.rates):
        try:
            doc, recorder = simulate_rate(bench, fleet, rate, i, trace, args)
        except SimulationStuck as e:  # the watchdog's report says what is stuck
            print(f"diptych simulate: error: {e}", file=sys.stderr)
            return 1
        if trace is not None:  # the trace's own timestamps set the pace
            doc["request_rate"] = None
            doc["dataset_name"] = str(args.trace)
        label = "trace" if trace is not None else doc["request_rate"]
        print(format_result(doc, bench.percentiles, []), flush=True)
        if args.planner:
            mode = f"{args.planner} planner from {fleet.prefill_workers}P{fleet.decode_workers}D"
        rt, leaks = doc["routing"], doc["kv_leaks"]
        assert isinstance(rt, Mapping) and isinstance(leaks, Sequence)  # as simulate_rate made them
        print(
            f"routing ({rt['router']}, {rt['frontends']} frontend(s)): prefix hit rate "
            f"{rt['prefix_hit_rate']:.1%}, max/mean requests per decode worker "
            f"{rt['spread_mean']:.2f} mean, {rt['spread_p95']:.2f} p95, "
            f"{rt.get('peer_pulled_blocks', 0):,} blocks pulled from peers", flush=True,
        )  # fmt: skip
        print(
            f"simulated {doc['duration']:.0f} s of {mode} in {doc['wall_s']:.1f} s of wall time, "
            f"{doc['accelerator_hours']:.2f} accelerator-hours"
            f"{'; KV LEAKED on ' + ', '.join(map(str, leaks)) if leaks else ''}",
            flush=True,
        )
        if out_dir is not None:
            stem = f"simulate-{mode.replace(' ', '-')}-{label}"
            (out_dir / f"{stem}.json").write_text(json.dumps(doc, indent=1))
            try:
                title = f"{doc['model_id']}, {mode}, {label} req/s"
                plot_timeline(recorder, out_dir / f"{stem}.png", title)
            except RuntimeError as e:
                print(f"warning: no timeline plot: {e}", file=sys.stderr)
        rows.append({k: v for k, v in doc.items() if k not in ("timeline", "busy")})
    if len(rows) > 1:
        print(format_sweep(rows, bench.goodput), flush=True)
        png = bench.plot
        if png is None and out_dir is not None:
            png = str(out_dir / f"simulate-{mode.replace(' ', '-')}-sweep.png")
        try:
            if png is not None:
                plot_sweep({mode: rows}, png, bench.goodput, f"simulated {mode}")
        except RuntimeError as e:
            print(f"warning: no sweep plot: {e}", file=sys.stderr)
    return 0 if all(not r["kv_leaks"] and r["failed"] == 0 for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diptych simulate", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))
