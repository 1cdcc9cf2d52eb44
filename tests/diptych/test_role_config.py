"""The typed configs `diptych serve` hands its children: built once from the flags,
passed as data, rebuilt and validated in the child."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decode_worker.config import DecodeWorkerConfig
from diptych import options
from diptych.cli import build_parser
from diptych.role_config import dumps, loads
from diptych.serve import _child_args
from engine.config import EngineConfig
from frontend.config import FrontendConfig
from prefill_worker.config import PrefillWorkerConfig


def _serve(*flags: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *flags])


def test_every_flag_reaches_the_child_config() -> None:
    args = _serve(
        "--dtype", "float32", "--block-size", "32", "--max-num-seqs", "7",
        "--scheduling-policy", "priority", "--transfer", "tcp", "--max-batch", "3",
        "--min-remote-prefill-tokens", "64", "--no-prefix-caching", "--namespace", "ns",
    )  # fmt: skip
    decode = options.decode_config(_child_args(args, "/state", worker_id="decode-1"))
    role, back, verbose = loads(dumps("decode", decode, verbose=True))
    assert (role, verbose) == ("decode", True)
    assert back == decode and isinstance(back.engine, EngineConfig)
    assert back.worker_id == "decode-1" and back.transfer_backend == "tcp"
    assert back.engine.block_size == 32 and back.engine.scheduling_policy == "priority"
    assert back.engine.max_num_seqs == 7 and not back.engine.enable_prefix_caching
    assert back.min_remote_prefill_tokens == 64 and back.discovery_url == "embedded:/state"
    assert back.namespace == "ns"
    prefill = options.prefill_config(_child_args(args, "/state", worker_id="prefill-0"))
    assert loads(dumps("prefill", prefill))[1] == prefill and prefill.max_batch == 3
    front = options.frontend_config(_child_args(args, "/state", host="0.0.0.0", port=9))
    assert loads(dumps("frontend", front))[1] == front


def test_tuples_and_dtypes_survive() -> None:
    import torch

    cfg = PrefillWorkerConfig(
        transfer_backend=("ucx", "tcp"), engine=EngineConfig(dtype=torch.bfloat16)
    )
    back = loads(dumps("prefill", cfg))[1]
    assert back.transfer_backend == ("ucx", "tcp") and back.engine.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.update(role="scheduler"), "unknown role"),
        (lambda d: d["config"].update(colour="red"), "colour"),
        (lambda d: d["config"]["engine"].update(block_size=3), "power of two"),
        (lambda d: d["config"].update(min_remote_prefill_tokens=0), "min_remote_prefill_tokens"),
    ],
)
def test_a_bad_config_is_refused_with_the_reason(change, message) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(dumps("decode", DecodeWorkerConfig()))
    change(doc)
    with pytest.raises(ValueError, match=message):
        loads(json.dumps(doc))


def test_the_role_and_the_config_type_must_agree() -> None:
    with pytest.raises(TypeError):
        dumps("decode", FrontendConfig())


def test_a_flags_file_and_the_address_a_pod_advertises(tmp_path: Path) -> None:
    """`@FILE` reads flags (a mounted ConfigMap), shell words with comments; a worker
    bound to every interface must say which address others dial."""
    flags = tmp_path / "engine.args"
    flags.write_text("# engine flags\n--max-model-len 4096  --block-size 32\n\n--dtype 'float32'\n")
    args = build_parser().parse_args(
        ["decode", f"@{flags}", "--host", "0.0.0.0", "--advertise-host", "10.1.2.3"]
    )
    assert (args.max_model_len, args.block_size, args.dtype) == (4096, 32, "float32")
    cfg = options.decode_config(args)
    assert (cfg.host, cfg.advertise_host) == ("0.0.0.0", "10.1.2.3")
    bare = build_parser().parse_args(["prefill", "--host", "0.0.0.0"])
    with pytest.raises(SystemExit, match="--advertise-host"):
        options.prefill_config(bare)


def _a_value(flag: object) -> tuple[list[str], object]:
    """Command-line words for a declared flag with a value other than its default, and
    the field value they should give."""
    from diptych.flags import Flag

    assert isinstance(flag, Flag)
    if flag.kind is bool:
        return [flag.name], not flag.default
    if flag.bounds.choices is not None:
        choice = next(c for c in flag.bounds.choices if c not in (None, flag.default))
        return [flag.name, str(choice)], choice
    if flag.kind is str:
        return [flag.name, "elsewhere"], "elsewhere"
    lo = flag.bounds.lo if flag.bounds.lo is not None else 0
    unit = flag.scale or 1
    shown = (lo / unit) + (1 if flag.kind is int else 0.5)
    if flag.bounds.hi is not None:
        shown = min(shown, flag.bounds.hi / unit)
    value = flag.kind(shown)
    want = value * unit if flag.scale else value
    if flag.scale and isinstance(flag.default, int):
        want = round(want)
    return [flag.name, str(value)], want


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_every_declared_worker_flag_reaches_its_field(role: str) -> None:
    """Iterated from the declarations: a field given `help` is a flag of its commands,
    and what the flag says is the field's value (no field is wired by hand)."""
    from diptych.flags import flags

    config_cls = DecodeWorkerConfig if role == "decode" else PrefillWorkerConfig
    build = options.decode_config if role == "decode" else options.prefill_config
    for cls, reach in ((config_cls, lambda c: c), (EngineConfig, lambda c: c.engine)):
        for flag in flags(cls):
            if flag.field in ("host", "advertise_host"):
                continue  # checked together below: an address to bind and one to dial
            words, want = _a_value(flag)
            if flag.field == "max_local_prefill_tokens":
                words += ["--min-remote-prefill-tokens", "1"]  # it must stay above it
            if flag.field == "tensor_parallel_nodes":  # the ranks split over them evenly
                words += ["--tensor-parallel-size", "64", "--tensor-parallel-leader", "a:1"]
            if flag.field == "expert_parallel_size":  # the experts over the TP ranks
                words += ["--tensor-parallel-size", words[1]]
            if flag.field == "kv_disk_dir":  # a directory and its size go together
                words += ["--kv-disk-gib", "1"]
            if flag.field == "kv_disk_bytes":
                words += ["--kv-disk-dir", "/tmp/kv"]
            config = build(build_parser().parse_args([role, *words]))
            assert getattr(reach(config), flag.field) == want, (role, flag.name)
    config = build(
        build_parser().parse_args([role, "--host", "0.0.0.0", "--advertise-host", "10.0.0.5"])
    )
    assert (config.host, config.advertise_host) == ("0.0.0.0", "10.0.0.5")
