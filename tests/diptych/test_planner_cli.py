"""`diptych planner` and `diptych serve --planner` flags: the configs they build and
the errors bad ones give."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diptych.cli import build_parser
from diptych.planner_options import plan_settings, planner_config

BAD_PROFILE = "H200:Llama-3.1-70B:tp1:float9"


def _config(*argv: str):  # type: ignore[no-untyped-def]
    return planner_config(build_parser().parse_args(["planner", *argv]))


def test_each_connector_gets_its_options() -> None:
    k8s = _config("--connector", "kubernetes", "--k8s-namespace", "llm",
                  "--prefill-deployment", "p", "--decode-deployment", "d")  # fmt: skip
    assert k8s.connector_options == {
        "namespace": "llm",
        "deployments": {"prefill": "p", "decode": "d"},
        "kubeconfig": None,
        "kinds": {},
    }
    lws = _config("--connector", "kubernetes", "--lws-pools", "decode")
    assert lws.connector_options["kinds"] == {"decode": "LeaderWorkerSet"}
    with pytest.raises(ValueError, match="not \\['router'\\]"):
        _config("--connector", "kubernetes", "--lws-pools", "router")
    ray = _config("--connector", "ray", "--ray-worker-args", "--engine sim --etcd e:2379",
                  "--ray-actor-options", '{"num_gpus": 1}')  # fmt: skip
    assert ray.connector_options == {
        "address": "auto", "worker_args": "--engine sim --etcd e:2379",
        "actor_options": {"num_gpus": 1},
    }  # fmt: skip
    local = _config("--connector", "local", "--launcher-url", "http://127.0.0.1:5")
    assert local.connector_options == {"url": "http://127.0.0.1:5"}
    plain = _config(
        "--etcd", "10.0.0.2:2379", "--policy", "load", "--frontend-url", "http://f:8000"
    )
    assert (plain.connector, plain.discovery_url, plain.frontend_urls) == (
        "none",
        "etcd://10.0.0.2:2379",
        ("http://f:8000",),
    )
    assert plain.plan.policy == "load"


def test_serve_planner_flag_takes_an_optional_policy() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).planner is None
    assert parser.parse_args(["serve", "--planner"]).planner == "sla"
    args = parser.parse_args(["serve", "--planner", "load", "--min-decode", "2"])
    assert (plan_settings(args).policy, plan_settings(args).min_decode) == ("load", 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--connector", "local"], "needs --launcher-url"),
        (["--planner-interval", "0"], "argument --planner-interval: must be in (0.0, inf]"),
        (["--max-decode", "-3"], "argument --max-decode: must be in [1, inf], got -3"),
        (["--ttft-slo-ms", "x"], "argument --ttft-slo-ms: not a number"),
        (["--min-decode", "5", "--max-decode", "2"], "minimum is above its maximum"),
        (["--connector", "ray", "--ray-actor-options", "[1]"], "must be a JSON object"),
        (["--frontend-url", "http://127.0.0.1:9", "--port", "0", "--profile", BAD_PROFILE],
         f"profile {BAD_PROFILE!r} is unusable"),
        (["--frontend-url", "http://127.0.0.1:9", "--port", "0", "--connector", "kubernetes",
          "--kubeconfig", "/nonexistent/kubeconfig"], "no credentials"),
    ],
)
def test_bad_planner_flags_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "diptych.cli", "planner", *argv],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_refuses_an_unreadable_planner_profile_before_starting_anything() -> None:
    argv = ["serve", "--engine", "sim", "--planner", "--planner-profile", "H200:Nope-70B"]
    proc = subprocess.run([sys.executable, "-m", "diptych.cli", *argv],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    assert "profile 'H200:Nope-70B' is unusable" in proc.stderr
    assert "Traceback" not in proc.stderr and "DIPTYCH_READY" not in proc.stdout
