"""The `diptych` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="auto", help="auto (bfloat16), bfloat16, float32, float16")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    g.add_argument("--kv-cache-memory", type=float, default=1.0, help="KV cache size in GiB (CPU)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diptych", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt, offline")
    gen.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    gen.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    _add_engine_args(gen)
    _add_sampling_args(gen)

    chat = sub.add_parser("chat", help="an interactive chat in the terminal, offline")
    chat.add_argument("--system", default=None, help="a system prompt")
    _add_engine_args(chat)
    _add_sampling_args(chat)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from diptych.offline import run_chat, run_generate
    from engine import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=args.stop,
        )
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            kv_cache_memory_bytes=int(args.kv_cache_memory * (1 << 30)),
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"diptych: error: {e}", file=sys.stderr)
        return 2
    if args.command == "generate":
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        try:
            run_generate(llm, prompt, params, chat=not args.raw)
        except ValueError as e:
            print(f"diptych: error: {e}", file=sys.stderr)
            return 2
    else:
        run_chat(llm, params, system=args.system)
    return 0


if __name__ == "__main__":
    sys.exit(main())
