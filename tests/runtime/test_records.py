"""Records and messages of the control plane: encoding, validation, versioning."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from runtime.errors import InvalidInput
from runtime.proto import diptych_runtime_pb2 as pb
from runtime.queue import DeadLetter, DeadLetterReason, RemotePrefillRequest
from runtime.queue.messages import SCHEMA_VERSION
from runtime.worker_info import TransferInfo, WorkerInfo
from tests.runtime.rt_helpers import request, worker


def test_worker_info_json_roundtrip_and_format() -> None:
    info = worker("decode-3", extra={"zone": "a"})
    data = info.to_json()
    assert WorkerInfo.from_json(data) == info
    d = json.loads(data)
    assert d["schema_version"] == 1
    assert d["transfer"] == {
        "backend": "tcp",
        "agent_name": "agent-decode-3",
        "metadata_b64": "AG1ldGH/",
        "kv_region": None,
        "kv_regions": [],
    }
    assert sorted(d["kv_layout"]) == sorted(
        [
            "block_size",
            "num_blocks",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "dtype",
            "model",
            "tp_size",
            "model_kv_heads",
            "layout_hash",
        ]
    )
    d["some_future_field"] = [1, 2]  # readers ignore what they do not know
    assert WorkerInfo.from_json(json.dumps(d)) == info


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("incarnation_id"), "missing 'incarnation_id'"),
        (lambda d: d.update(schema_version=2), "schema_version 2"),
        (lambda d: d.update(grpc_address="nohost"), "grpc_address"),
        (lambda d: d["kv_layout"].update(block_size=0), "block_size"),
        (lambda d: d["kv_layout"].update(dtype="float13"), "dtype"),
        (lambda d: d["transfer"].update(metadata_b64="@@@"), "base64"),
        (lambda d: d.update(role="Decode"), "role"),
        (lambda d: d.update(kv_layout=[1]), "kv_layout must be an object"),
        (lambda d: d["transfer"].update(kv_regions=[-1]), "kv_regions"),
        (lambda d: d["transfer"].update(kv_regions=["0"]), "kv_regions"),
        (lambda d: d["transfer"].update(kv_regions=0), "kv_regions"),
        (lambda d: d.update(max_model_len=1), "max_model_len"),
        (lambda d: d.update(max_model_len=True), "max_model_len"),
    ],
)
def test_malformed_worker_records_are_refused_with_the_reason(mutate, message) -> None:  # type: ignore[no-untyped-def]
    d = json.loads(worker("w").to_json())
    mutate(d)
    with pytest.raises(InvalidInput, match=message):
        WorkerInfo.from_json(json.dumps(d))


def test_typed_fields_roundtrip() -> None:
    info = worker("d", max_model_len=8192)
    info = WorkerInfo.from_json(
        WorkerInfo(
            info.worker_id, info.role, info.model, transfer=TransferInfo("shm", "a", b"", (3,)),
            max_model_len=8192,
        ).to_json()
    )  # fmt: skip
    assert info.max_model_len == 8192
    assert info.transfer is not None and info.transfer.kv_region == 3


def test_a_split_pool_publishes_a_region_per_rank_and_old_records_still_read() -> None:
    split = TransferInfo("tcp", "a", b"", (4, 5, 6))
    assert TransferInfo.from_dict(split.to_dict()) == split and split.kv_region == 4
    old = {"backend": "tcp", "agent_name": "a", "metadata_b64": "", "kv_region": 2}
    assert TransferInfo.from_dict(old).kv_regions == (2,)
    assert TransferInfo.from_dict({**old, "kv_region": None}).kv_region is None
    with pytest.raises(InvalidInput, match="not an integer"):
        TransferInfo.from_dict({**old, "kv_regions": [1, -1]})


def test_prefill_request_roundtrip_and_size() -> None:
    sent = request(1, tokens=128 * 1024)
    data = sent.encode()
    assert RemotePrefillRequest.decode(data) == sent
    assert len(data) < 450_000  # a 128k prompt fits NATS's default 1 MiB payload


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_cached_tokens": 8}, "num_cached_tokens"),
        ({"prompt_token_ids": ()}, "prompt_token_ids must not be empty"),
        ({"prompt_token_ids": (1, -2)}, r"prompt_token_ids\[1\]"),
        ({"dst_block_ids": tuple(range(9))}, "more blocks than tokens"),
        ({"decode_worker_id": "a.b"}, "decode_worker_id"),
        ({"deadline": math.nan}, "deadline"),
        ({"request_id": ""}, "request_id"),
        ({"kv_layout_hash": ""}, "kv_layout_hash"),
    ],
)
def test_prefill_request_validation(change: dict[str, object], message: str) -> None:
    fields = {**request(1).__dict__, **change}
    with pytest.raises(InvalidInput, match=message):
        RemotePrefillRequest(**fields)  # type: ignore[arg-type]


def test_prefill_request_decode_errors_are_clear() -> None:
    with pytest.raises(InvalidInput, match="malformed RemotePrefillRequest"):
        RemotePrefillRequest.decode(b"\xff\xff\xff\xff")
    with pytest.raises(InvalidInput, match="no schema_version"):
        RemotePrefillRequest.decode(pb.RemotePrefillRequest(request_id="x").SerializeToString())
    future = pb.RemotePrefillRequest.FromString(request(1).encode())
    future.schema_version = SCHEMA_VERSION + 1
    with pytest.raises(InvalidInput, match="newer than this worker understands"):
        RemotePrefillRequest.decode(future.SerializeToString())
    older = pb.RemotePrefillRequest.FromString(request(1).encode())
    older.schema_version = 1
    with pytest.raises(InvalidInput, match="upgrade the decode workers"):
        RemotePrefillRequest.decode(older.SerializeToString())
    broken = pb.RemotePrefillRequest.FromString(request(1).encode())
    broken.sampling = b'{"top_p": 7.0}'
    with pytest.raises(InvalidInput, match="top_p"):
        RemotePrefillRequest.decode(broken.SerializeToString())


def test_dead_letter_roundtrip() -> None:
    letter = DeadLetter("req-1", "decode-0", DeadLetterReason.DEADLINE, "late", 2, time.time())
    assert DeadLetter.decode(letter.encode()) == letter


def test_generated_protobuf_module_matches_the_proto(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The committed diptych_runtime_pb2.py was regenerated after the last .proto edit."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    from google.protobuf import descriptor_pb2

    proto_dir = Path(pb.__file__).parent
    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", f"-I{proto_dir}", f"--descriptor_set_out={out}",
                        str(proto_dir / "diptych_runtime.proto")]) == 0  # fmt: skip
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    messages = list(fresh.message_type)
    while messages:  # protoc adds json names only to descriptor sets
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    assert fresh == committed, "run python runtime/proto/generate.py"


def _pairs() -> list[tuple[type, type]]:
    from runtime.queue.messages import DeadLetter, RemotePrefillRequest
    from runtime.rpc.types import GenerateRequest, HealthReport, LoadReport, Usage

    return [(GenerateRequest, pb.GenerateRequest), (RemotePrefillRequest, pb.RemotePrefillRequest),
            (DeadLetter, pb.DeadLetter), (Usage, pb.Usage), (LoadReport, pb.LoadReport),
            (HealthReport, pb.HealthResponse)]  # fmt: skip


@pytest.mark.parametrize(("cls", "message"), _pairs(), ids=lambda x: getattr(x, "__name__", ""))
def test_every_field_has_its_place_on_the_wire(cls: type, message: type) -> None:
    """The conversions iterate the dataclass's fields (protocol/declare.py): a field
    added to a dataclass and not to its message fails here by name, unless it says it
    travels beside the message (``local``: a call's trace context, in its metadata)."""
    import dataclasses

    names = message.DESCRIPTOR.fields_by_name  # type: ignore[attr-defined]
    fields = [f for f in dataclasses.fields(cls) if not f.metadata.get("local")]
    missing = [f.name for f in fields if f.name not in names]
    assert not missing, f"{message.__name__} lacks {missing}"


def test_load_usage_and_health_cross_the_wire_field_by_field() -> None:
    import dataclasses

    from runtime.rpc import types as wire

    special = {"extra": {"a": 1.5}, "lora_resident": ("ad-1", "ad-2")}
    load = wire.LoadReport(**{
        f.name: special.get(f.name, i + 1)
        for i, f in enumerate(dataclasses.fields(wire.LoadReport))
    })  # fmt: skip
    assert wire.load_from_pb(wire.load_to_pb(load)) == load
    usage = wire.Usage(3, 4, 2, True)
    back = wire.chunk_from_pb(wire.chunk_to_pb(wire.GenerateChunk(usage=usage)))
    assert not isinstance(back, tuple) and back.usage == usage
    health = wire.HealthReport(wire.ServingStatus.DRAINING, "w", "inc", "busy", load, 0)
    got = wire.health_from_pb(wire.health_to_pb(health, in_flight=5))
    assert got == dataclasses.replace(health, requests_in_flight=5)
