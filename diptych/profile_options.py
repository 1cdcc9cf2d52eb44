"""`diptych profile`'s flags, apart from the profiler so that building the command
line's parser imports no engine."""

from __future__ import annotations

import argparse


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers, comma-separated") from None
    if not values or values[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 0")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("profile")
    g.add_argument("--output", default="profile.json", help="the profile JSON (a PNG beside)")
    g.add_argument("--prefill-tokens", type=_ints, default=_ints("16,64,256,1024,2048"))
    g.add_argument("--cached-tokens", type=_ints, default=_ints("0,512,1536"))
    g.add_argument("--batch-sizes", type=_ints, default=_ints("1,2,4,8,16,32,64"))
    g.add_argument("--contexts", type=_ints, default=_ints("128,512,1536"))
    g.add_argument("--mixed-tokens", type=_ints, default=_ints("64,256,1024"))
    g.add_argument("--mixed-batches", type=_ints, default=_ints("1,8,32"))
    g.add_argument("--repeats", type=int, default=3)
    g.add_argument(
        "--url", default=None, help="profile this running server (its /v1/completions) instead"
    )
