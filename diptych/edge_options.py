"""Flags of the frontend's edge: API keys, HTTPS, load shedding (`diptych serve` and
`diptych frontend` take the same)."""

from __future__ import annotations

import argparse
from typing import Any


def add_edge_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API access and overload (frontend)")
    g.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="require `Authorization: Bearer KEY` on the API (repeat for several keys; "
        "/health, /ready and /metrics stay open). Prefer --api-key-file or the "
        "DIPTYCH_API_KEY environment variable (comma-separated): a flag shows in `ps`",
    )  # fmt: skip
    g.add_argument(
        "--api-key-file", action="append", default=[], metavar="PATH",
        help="a file of accepted API keys, one per line (# comments)",
    )  # fmt: skip
    g.add_argument("--tls-certfile", default=None, help="serve the API over HTTPS: PEM cert")
    g.add_argument("--tls-keyfile", default=None, help="...and its PEM private key")
    g.add_argument(
        "--max-queued-per-worker", type=int, default=None,
        help="answer 429 (Retry-After) once every decode worker has this many requests "
        "queued beyond those it runs (default: each worker's own --max-queued-requests); "
        "batch requests (X-Priority: batch, or priority > 0) from --shed-batch-at of it; "
        "0 never sheds",
    )  # fmt: skip
    g.add_argument(
        "--shed-batch-at", type=float, default=0.5,
        help="share of --max-queued-per-worker from which batch requests are refused",
    )  # fmt: skip
    g.add_argument(
        "--max-in-flight", type=int, default=0,
        help="requests this frontend serves at once before answering 429 (0: no limit)",
    )  # fmt: skip
    g.add_argument("--retry-after", type=float, default=1.0, help="seconds told to refused clients")


def edge_config(args: Any) -> dict[str, Any]:
    """The FrontendConfig fields these flags set."""
    from frontend.auth import api_keys_from_env, collect_api_keys
    from frontend.config import AdmissionConfig

    try:
        keys = collect_api_keys(args.api_key, args.api_key_file, api_keys_from_env())
    except ValueError as e:
        raise SystemExit(f"diptych: {e}") from None
    return {
        "api_keys": keys,
        "tls_certfile": args.tls_certfile,
        "tls_keyfile": args.tls_keyfile,
        "admission": AdmissionConfig(
            max_queued_per_worker=args.max_queued_per_worker,
            batch_share=args.shed_batch_at,
            max_in_flight=args.max_in_flight or None,
            retry_after_s=args.retry_after,
        ),
    }
