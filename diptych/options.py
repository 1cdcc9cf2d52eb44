"""Command-line options of every `diptych` command, and the configs they build."""

from __future__ import annotations

import argparse
from typing import Any

from diptych.edge_options import add_edge_args

GiB = 1 << 30


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="a .gguf file or HF directory (default: SmolLM2-135M)"
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 where this CPU or GPU has a fast bf16 path, else float32), "
        "bfloat16, float32, float16",
    )
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV cache GiB (CPU)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides memory)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs, or priority: lower request priority first, preempting the lowest",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--engine",
        default="model",
        choices=["model", "sim"],
        help="model: run the weights; sim: a simulated engine on a timing model "
        "(--model then only names the tokenizer)",
    )
    g.add_argument(
        "--profile",
        default=None,
        help="--engine sim's timing: ACCELERATOR:MODEL[:tpN] (a roofline of shipped data, "
        "e.g. H200:Llama-3.1-70B:tp8) or a `diptych profile` JSON (default H100:Llama-3.1-8B)",
    )
    g.add_argument(
        "--sim-kv-scale",
        type=float,
        default=1 / 1024,
        help="--engine sim: KV bytes written per token, as a fraction of the device's",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="--engine sim: simulated seconds per wall second (time dilation)",
    )
    g.add_argument(
        "--sim-mean-output-tokens",
        type=int,
        default=256,
        help="--engine sim: mean reply length before the simulated model's EOS (0: never)",
    )
    g.add_argument(
        "--quantization",
        default=None,
        choices=["gguf", "int8", "int4"],
        help="keep linear weights quantized: gguf (a GGUF's Q4_0/Q4_1/Q4_K/Q8_0/Q6_K/Q5_0 "
        "blocks as stored), int8 (per output channel) or int4 (per 32 values), both "
        "quantized at load (default: dense weights in --dtype)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "int8", "fp8", "fp8_e4m3"],
        help="auto: the KV cache in --dtype; int8 / fp8 (e4m3): each K/V row as one-byte "
        "codes with an fp16 scale per token and head (about half the bytes of bf16: twice "
        "the tokens fit, and a remote prefill moves half as much). Prefill and decode "
        "workers must agree",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="speculative decoding: draft up to N tokens a step (by prompt lookup from the "
        "request's own context, or with --speculative-model) and verify them in one pass; "
        "the output is the model's own (greedy: identical; sampled: the same "
        "distribution). 0: off; 2-4 suit code edits and quoting",
    )
    g.add_argument(
        "--speculative-model",
        default=None,
        help="draft with this smaller model of the same tokenizer (a GGUF or safetensors "
        "path) instead of prompt lookup; it runs in this process with its own KV cache",
    )
    g.add_argument(
        "--speculative-quantization",
        default=None,
        choices=["gguf", "int8", "int4"],
        help="keep the draft model's linear weights quantized, as --quantization",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads of each engine process (default: the machine's cores, shared "
        "out among the engine processes `diptych serve` starts)",
    )
    g.add_argument(
        "--no-weight-prepack",
        action="store_true",
        help="CPU bf16: skip the packed copy of the weights (saves their size in memory, "
        "slower above batch 3)",
    )


def sim_config(args: Any) -> Any:
    """`--engine sim`'s SimConfig, or None for the real model."""
    if getattr(args, "engine", "model") != "sim":
        if args.profile is not None:
            raise SystemExit("--profile needs --engine sim")
        return None
    from engine.sim.config import DEFAULT_PROFILE, SimConfig
    from engine.sim.timing import load_timing

    try:
        load_timing(args.profile or DEFAULT_PROFILE)  # a bad spec fails here, not in a child
        return SimConfig(
            profile=args.profile or DEFAULT_PROFILE,
            kv_scale=args.sim_kv_scale,
            speedup=args.time_scale,
            mean_output_tokens=args.sim_mean_output_tokens,
        )
    except (ValueError, OSError) as e:
        raise SystemExit(f"--engine sim: {e}") from None


def engine_kwargs(args: Any) -> dict[str, Any]:
    return {
        "sim": sim_config(args),
        "dtype": args.dtype,
        "device": args.device,
        "kv_cache_memory_bytes": int(args.kv_cache_memory * GiB),
        "num_blocks": args.num_blocks,
        "block_size": args.block_size,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "scheduling_policy": args.scheduling_policy,
        "enable_prefix_caching": not args.no_prefix_caching,
        "cpu_weight_prepack": not args.no_weight_prepack,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_model": args.speculative_model,
        "speculative_quantization": args.speculative_quantization,
        "threads": args.threads,
    }


def engine_config(args: Any) -> Any:
    from engine import EngineConfig

    return EngineConfig(model=args.model, **engine_kwargs(args))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: Any) -> Any:
    from engine import SamplingParams

    names = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return SamplingParams(**{n: getattr(args, n) for n in names}, seed=args.seed, stop=args.stop)


def add_control_plane_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("control plane")
    g.add_argument("--etcd", default=None, help="etcd for discovery: host:port[,host:port]")
    g.add_argument(
        "--discovery",
        default=None,
        help="discovery by URL instead: etcd://host:port, kubernetes://[namespace] (Leases "
        "through the Kubernetes API; in a pod, its service account and namespace)",
    )
    g.add_argument("--nats", default=None, help="NATS JetStream for the prefill queue: host:port")
    g.add_argument(
        "--state-dir",
        default=None,
        help="embedded control plane directory (when --etcd/--nats are not given)",
    )
    g.add_argument("--namespace", default="default")


def _url(scheme: str, value: str | None, state_dir: str | None) -> str:
    if value:
        return value if "://" in value else f"{scheme}://{value}"
    return f"embedded:{state_dir}" if state_dir else "embedded"


def discovery_url(args: Any) -> str:
    url = getattr(args, "discovery", None)
    if url:
        if args.etcd:
            raise SystemExit("diptych: give --etcd or --discovery, not both")
        return str(url)
    return _url("etcd", args.etcd, args.state_dir)


def queue_url(args: Any) -> str:
    return _url("nats", args.nats, args.state_dir)


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transfer",
        default="shm",
        choices=["shm", "tcp", "nixl", "ucx", "auto"],
        help="KV transfer backend between prefill and decode workers (default: shm)",
    )


def add_worker_args(p: argparse.ArgumentParser, default_id: str) -> None:
    g = p.add_argument_group("worker")
    g.add_argument("--worker-id", default=default_id)
    g.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    g.add_argument(
        "--advertise-host",
        default=None,
        help="address others dial, written into discovery (default: --host; needed when "
        "--host is 0.0.0.0, e.g. the pod IP on Kubernetes)",
    )
    g.add_argument(
        "--port", type=int, default=0,
        help="gRPC port (0 = any free): a decode worker's request plane, a prefill worker's "
        "KV events for decode workers",
    )  # fmt: skip
    g.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = any free)")
    add_drain_arg(g)


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregation (decode workers)")
    g.add_argument(
        "--no-remote-prefill", action="store_true", help="always prefill on the decode worker"
    )
    g.add_argument(
        "--min-remote-prefill-tokens",
        type=int,
        default=128,
        help="prefill remotely only when at least this many prompt tokens are uncached",
    )
    g.add_argument(
        "--min-remote-prefill-share", type=float, default=0.5,
        help="...and they are at least this share of the prompt (a worker holding most of a "
        "prompt, a conversation's history, prefills the rest itself)",
    )  # fmt: skip
    g.add_argument(
        "--max-local-prefill-tokens", type=int, default=4096,
        help="...unless at least this many are uncached: then remotely whatever is held",
    )  # fmt: skip
    g.add_argument(
        "--max-queue-depth", type=int, default=64, help="prefill locally beyond this queue depth"
    )
    g.add_argument(
        "--max-queued-requests", type=int, default=256,
        help="a decode worker refuses (RESOURCE_EXHAUSTED: the frontend tries another, "
        "then answers 429) a request beyond this many queued behind those it runs",
    )  # fmt: skip
    g.add_argument(
        "--remote-prefill-timeout",
        type=float,
        default=30.0,
        help="seconds before a remote prefill is given up and done locally",
    )
    g.add_argument(
        "--no-prefill-affinity", action="store_true",
        help="send every remote prefill to the shared queue, not first to the prefill "
        "worker whose cache holds most of it",
    )  # fmt: skip
    g.add_argument(
        "--prefill-affinity-wait", type=float, default=1.0,
        help="seconds a remote prefill waits for the prefill worker it prefers before any "
        "may take it",
    )  # fmt: skip


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill workers")
    g.add_argument(
        "--max-batch", type=int, default=8, help="prompts a prefill worker takes at once"
    )


def add_drain_arg(g: Any, default: float = 60.0) -> None:
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=default,
        help="seconds a stopping worker gives what it holds to finish (after leaving "
        "discovery and taking no new work); a stopping frontend, its streams in flight "
        "(after closing its listening socket)",
    )


_ANY_ADDRESS = ("0.0.0.0", "::", "")


def _worker_fields(args: Any) -> dict[str, Any]:
    """The settings every worker role takes (`worker.config.WorkerConfig`)."""
    advertise = getattr(args, "advertise_host", None)  # serve's workers bind its --host
    if args.host in _ANY_ADDRESS and not advertise:
        raise SystemExit(
            f"diptych: --host {args.host or '(empty)'} binds every interface; pass "
            "--advertise-host, the address the frontend and peers dial"
        )
    return {
        "worker_id": args.worker_id,
        "namespace": args.namespace,
        "discovery_url": discovery_url(args),
        "queue_url": queue_url(args),
        "engine": engine_config(args),
        "host": args.host,
        "advertise_host": advertise,
        "metrics_port": args.metrics_port,
        "transfer_backend": args.transfer,
        "drain_timeout": args.drain_timeout,
    }


def decode_config(args: Any) -> Any:
    from decode_worker.config import DecodeWorkerConfig

    return DecodeWorkerConfig(
        **_worker_fields(args),
        port=args.port,
        served_model_name=getattr(args, "served_model_name", None),
        remote_prefill=not args.no_remote_prefill,
        min_remote_prefill_tokens=args.min_remote_prefill_tokens,
        min_remote_prefill_share=args.min_remote_prefill_share,
        max_local_prefill_tokens=args.max_local_prefill_tokens,
        max_queue_depth=args.max_queue_depth,
        max_queued_requests=args.max_queued_requests,
        remote_prefill_timeout=args.remote_prefill_timeout,
        prefill_affinity=not args.no_prefill_affinity,
        prefill_affinity_wait=args.prefill_affinity_wait,
    )


def prefill_config(args: Any) -> Any:
    from prefill_worker.config import PrefillWorkerConfig

    return PrefillWorkerConfig(**_worker_fields(args), port=args.port, max_batch=args.max_batch)


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("frontend")
    g.add_argument("--model", default=None, help="model whose tokenizer to use (default model)")
    g.add_argument("--served-model-name", default=None, help="name clients use in requests")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    add_drain_arg(g, default=30.0)
    add_router_args(p)
    add_edge_args(p)


def add_router_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing (frontend)")
    g.add_argument(
        "--router", choices=("kv", "least-loaded"), default="kv",
        help="kv: the decode worker holding most of the prompt, weighed against its load "
        "(default); least-loaded: the one with the fewest requests",
    )  # fmt: skip
    g.add_argument(
        "--router-overlap-weight", type=float, default=4.0,
        help="a prompt token to prefill against a token of context the worker's running "
        "requests read each decode step (default 4)",
    )  # fmt: skip
    g.add_argument(
        "--router-temperature", type=float, default=0.0,
        help="0 takes the cheapest worker; above 0 samples workers by softmax of -cost",
    )  # fmt: skip
    g.add_argument(
        "--no-kv-events", dest="kv_events", action="store_false",
        help="approximate KV routing: predict what workers cache from this frontend's own "
        "routing (for workers that publish no KV events)",
    )  # fmt: skip
    g.add_argument(
        "--router-predict-ttl", type=float, default=120.0,
        help="with --no-kv-events: seconds a predicted cached prefix lasts after its last use",
    )  # fmt: skip
    g.add_argument(
        "--session-affinity", action="store_true",
        help="treat a request's X-Session-Id header (or its `user`) as a sticky hint: its "
        "last worker is assumed to hold the session's history",
    )  # fmt: skip


def _kv_router_config(args: Any) -> Any:
    from frontend.config import KvRouterConfig

    return KvRouterConfig(
        overlap_weight=args.router_overlap_weight,
        temperature=args.router_temperature,
        kv_events=args.kv_events,
        predict_ttl_s=args.router_predict_ttl,
        session_affinity=args.session_affinity,
    )


def _simulated_model_name(args: Any) -> str | None:
    """Under `--engine sim` clients name the simulated model (its tokenizer's is a proxy)."""
    if getattr(args, "engine", "model") != "sim":
        return None
    from engine.sim.config import DEFAULT_PROFILE
    from engine.sim.timing import load_timing

    return load_timing(args.profile or DEFAULT_PROFILE).model.name


def frontend_config(args: Any) -> Any:
    from diptych.edge_options import edge_config
    from frontend.config import FrontendConfig

    return FrontendConfig(
        model=args.model,
        served_model_name=args.served_model_name or _simulated_model_name(args),
        time_scale=args.time_scale if getattr(args, "engine", "model") == "sim" else 1.0,
        discovery_url=discovery_url(args),
        namespace=args.namespace,
        host=args.host,
        port=args.port,
        router=args.router,
        kv_router=_kv_router_config(args),
        drain_timeout_s=args.drain_timeout,
        **edge_config(args),
    )


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serve")
    g.add_argument("--host", default="127.0.0.1", help="frontend address")
    g.add_argument("--port", type=int, default=8000, help="frontend port")
    g.add_argument("--served-model-name", default=None)
    g.add_argument(
        "--prefill-workers", type=int, default=1, help="0 runs aggregated (decode workers only)"
    )
    g.add_argument("--decode-workers", type=int, default=1)
    g.add_argument(
        "--state-dir", default=None, help="embedded control plane directory (default: temporary)"
    )
    g.add_argument("--etcd", default=None, help="use etcd for discovery instead (host:port)")
    g.add_argument("--nats", default=None, help="use NATS JetStream for the queue (host:port)")
    g.add_argument("--namespace", default="default")
    g.add_argument("--startup-timeout", type=float, default=300.0)
    add_drain_arg(g)
    g.add_argument(
        "--startup-parallelism",
        type=int,
        default=None,
        help="workers started at once (default: 2 per CPU, at least 4)",
    )
