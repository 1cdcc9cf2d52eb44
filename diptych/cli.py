"""The `diptych` command line.

diptych serve                     frontend + 1 prefill + 1 decode worker, one machine
diptych frontend|decode|prefill   one role, for multi-node use (--etcd, --nats)
diptych generate "prompt"         offline, in-process
diptych chat                      offline, interactive
diptych bench                     load-test any OpenAI-compatible server (bench/)
diptych profile                   time this machine's engine into a --engine sim profile
diptych simulate                  a bench workload through a simulated fleet, virtual time
diptych planner                   scale the pools of a running fleet; live dashboard
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from diptych import options
from diptych.flags import show_defaults

if TYPE_CHECKING:
    from diptych.role_config import RoleConfig


class _Parser(argparse.ArgumentParser):
    """`@FILE` in the arguments reads more arguments from FILE (a mounted ConfigMap of
    engine flags, say): shell-like words, any number per line, `#` starts a comment."""

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        return shlex.split(arg_line, comments=True)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="diptych",
        description="Disaggregated prefill/decode LLM serving.",
        fromfile_prefix_chars="@",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server on this machine: frontend + prefill + decode",
        description="Start the frontend, decode workers and prefill workers as local "
        "processes on the embedded control plane (no etcd or NATS needed).",
    )
    options.add_serve_args(serve)
    from diptych.planner_options import add_planner_process_arguments, add_serve_planner_arguments

    add_serve_planner_arguments(serve)

    plan = sub.add_parser(
        "planner",
        help="scale the prefill and decode pools of a running fleet, with a live dashboard",
        description="Read the frontends' and workers' metrics, predict the load, and scale "
        "each pool through a connector (local, kubernetes, ray) against an SLA or load "
        "thresholds; serves /dashboard and /metrics.",
    )
    options.add_control_plane_args(plan)
    add_planner_process_arguments(plan)

    front = sub.add_parser("frontend", help="run the OpenAI HTTP frontend only")
    options.add_control_plane_args(front)
    options.add_frontend_args(front)

    from decode_worker.config import DecodeWorkerConfig
    from prefill_worker.config import PrefillWorkerConfig

    dec = sub.add_parser("decode", help="run one decode worker")
    options.add_control_plane_args(dec)
    options.add_worker_args(dec, DecodeWorkerConfig)
    options.add_engine_args(dec)

    pre = sub.add_parser("prefill", help="run one prefill worker")
    options.add_control_plane_args(pre)
    options.add_worker_args(pre, PrefillWorkerConfig)
    options.add_engine_args(pre)

    gen = sub.add_parser("generate", help="generate a completion for one prompt, offline")
    gen.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    gen.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    options.add_engine_args(gen)
    options.add_sampling_args(gen)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal, offline")
    chat.add_argument("--system", default=None, help="a system prompt")
    options.add_engine_args(chat)
    options.add_sampling_args(chat)

    bench = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (flags as in `vllm bench serve`)",
        description="Drive an OpenAI-compatible server with a workload and report TTFT, "
        "TPOT, ITL, E2EL, throughput and goodput; several --request-rate values sweep.",
    )
    from bench.cli import add_arguments as add_bench_args

    add_bench_args(bench)

    prof = sub.add_parser(
        "profile",
        help="time a real engine's prefill and decode steps into a --engine sim profile",
        description="Measure this machine's engine (the flags as for serve): prefill time "
        "over prompt and cached-prefix length, decode step time over batch and context. "
        "Writes the JSON profile `--engine sim --profile` and `diptych simulate` take, "
        "and a PNG.",
    )
    options.add_engine_args(prof)
    from diptych.profile_options import add_arguments as add_profile_args

    add_profile_args(prof)

    node = sub.add_parser(
        "tp-node",
        help="run this host's ranks of a tensor-parallel group that spans hosts",
        description="Start this host's share of the ranks of a decode or prefill worker "
        "whose --tensor-parallel-nodes is above 1 (a LeaderWorkerSet's worker pod): they "
        "meet rank 0 at the leader's address and run every step it sends; exits when the "
        "worker ends the group (0) or a rank fails.",
    )
    node.add_argument("--leader", required=True, metavar="HOST:PORT",
                      help="the worker's --tensor-parallel-leader")  # fmt: skip
    node.add_argument("--node", type=int, required=True, metavar="N",
                      help="this host's index in the group, 1.. (the worker's is 0)")  # fmt: skip
    sim = sub.add_parser(
        "simulate",
        help="a bench workload through a simulated fleet in virtual time (no processes)",
        description="Run a `diptych bench` workload through simulated prefill and decode "
        "workers (the real scheduler and KV cache on a timing model) in virtual time, and "
        "report what `diptych bench` would, plus a timeline.",
    )
    from diptych.simulate.options import add_arguments as add_simulate_args

    add_simulate_args(sim)
    for command in sub.choices.values():  # hand-written flags say their defaults too
        for group in command._action_groups:
            show_defaults(group)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Ctrl-C at any moment before a command takes over SIGINT itself
    (`diptych serve` does, to stop its children) ends with "interrupted" and exit code
    1, not a traceback: this module and the parser import nothing heavy (each
    command's own modules load when it runs), and the rest of start-up is inside the
    handler below."""
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if args.command in ("decode", "prefill", "frontend", "planner"):
            from diptych.roles import show_startup

            show_startup(f"diptych {args.command}: ")
        return _dispatch(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"diptych: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("diptych: interrupted", file=sys.stderr)
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    from diptych import roles

    if args.command == "bench":
        from bench.cli import run_from_args

        return run_from_args(args)
    if args.command == "profile":
        from diptych.profile import run as run_profile

        return run_profile(options.engine_config(args), args)
    if args.command == "simulate":
        from diptych.simulate.cli import run

        return run(args)
    if args.command == "serve":
        from diptych.serve import serve

        return serve(args)
    if args.command == "tp-node":
        from engine.parallel.ranks import run_node

        return run_node(args.leader, args.node)
    if args.command == "planner":
        from diptych.planner_options import planner_config

        return roles.run_role("planner", planner_config(args))
    configs: dict[str, Callable[[argparse.Namespace], RoleConfig]] = {
        "decode": options.decode_config,
        "prefill": options.prefill_config,
        "frontend": options.frontend_config,
    }
    if args.command in configs:
        return roles.run_role(args.command, configs[args.command](args))
    return _offline(args)


def _offline(args: argparse.Namespace) -> int:
    from diptych.offline import run_chat, run_generate
    from engine import LLM

    params = options.sampling_params(args)
    llm = LLM.from_config(options.engine_config(args))
    if args.command == "generate":
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        run_generate(llm, prompt, params, chat=not args.raw)
    else:
        run_chat(llm, params, system=args.system)
    return 0


if __name__ == "__main__":
    sys.exit(main())
