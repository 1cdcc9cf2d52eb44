"""The discovery record of a worker: who it is, where to reach it, what KV layout it holds.

Stored as JSON under ``/diptych/{namespace}/{role}/{worker_id}``::

    {
      "schema_version": 1,
      "worker_id": "decode-0", "role": "decode", "incarnation_id": "9f0c...",
      "model": "HuggingFaceTB/SmolLM2-135M",
      "grpc_address": "10.0.0.5:50051", "metrics_address": "10.0.0.5:9100",
      "transfer": {"backend": "tcp", "agent_name": "decode-0-9f0c", "metadata_b64": "...",
                   "kv_region": 0, "kv_regions": [0]},
      "kv_layout": {"num_blocks": 4096, "num_layers": 30, "block_size": 16,
                    "num_kv_heads": 3, "head_dim": 64, "dtype": "bfloat16",
                    "model": "SmolLM2-135M-Instruct", "layout_hash": "5d41402abc4b2a76"},
      "max_model_len": 8192,
      "started_at": 1733000000.0,
      "extra": {}
    }

Transfer agent metadata is opaque bytes, carried as base64; ``kv_regions`` are the ids of
the agent regions that hold the KV pool (peers write into them), one a tensor-parallel
rank in rank order, and ``kv_region`` the first (what readers before tensor parallelism
read). ``kv_layout`` is the engine's
own ``protocol.kv_layout.KvLayout``; a reader recomputes its ``layout_hash`` from the
fields and refuses a record whose hash disagrees. Readers ignore unknown
keys, so fields can be added without a version bump; ``schema_version`` changes only when
an existing field changes meaning. ``extra`` is free-form and nothing reads it.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from protocol.declare import check_name, check_worker_id, json_object
from protocol.kv_layout import KvLayout
from runtime.errors import InvalidInput

SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024  # transfer metadata of a NIXL agent is a few KiB


def new_incarnation_id() -> str:
    """A fresh id for one process lifetime; a restarted worker gets a new one."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class TransferInfo:
    """How peers reach this worker's KV memory; ``metadata`` is the agent's opaque blob."""

    backend: str
    agent_name: str
    metadata: bytes = b""
    # the regions holding the KV pool, a tensor-parallel rank's each; empty: no writes
    kv_regions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_name("transfer.backend", self.backend)
        if not isinstance(self.kv_regions, tuple) or len(self.kv_regions) > 1024:
            raise InvalidInput("transfer.kv_regions must be a list of at most 1024 ids")
        for r in self.kv_regions:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise InvalidInput(f"transfer.kv_regions holds {r!r}, not an integer >= 0")
        if not isinstance(self.agent_name, str) or not 1 <= len(self.agent_name) <= 256:
            raise InvalidInput("transfer.agent_name must be a non-empty string (<= 256 chars)")
        if not isinstance(self.metadata, bytes):
            raise InvalidInput("transfer.metadata must be bytes")

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "agent_name": self.agent_name,
            "metadata_b64": base64.b64encode(self.metadata).decode(),
            "kv_region": self.kv_region,
            "kv_regions": list(self.kv_regions),
        }

    @property
    def kv_region(self) -> int | None:
        """Rank 0's region (None: the worker takes no writes)."""
        return self.kv_regions[0] if self.kv_regions else None

    @classmethod
    def from_dict(cls, d: Any) -> TransferInfo:
        if not isinstance(d, dict):
            raise InvalidInput(f"transfer must be an object, got {type(d).__name__}")
        try:
            blob = base64.b64decode(d.get("metadata_b64", ""), validate=True)
            regions = d.get("kv_regions")
            if regions is None:  # a record written before tensor parallelism
                regions = [] if d.get("kv_region") is None else [d["kv_region"]]
            if not isinstance(regions, list):
                raise InvalidInput("transfer.kv_regions must be a list")
            return cls(d["backend"], d["agent_name"], blob, tuple(regions))
        except KeyError as e:
            raise InvalidInput(f"transfer is missing {e.args[0]!r}") from None
        except (binascii.Error, TypeError) as e:
            raise InvalidInput(f"transfer.metadata_b64 is not base64: {e}") from None


# `WorkerInfo.extra`'s key for the largest LoRA rank a worker serves (absent: none)
LORA_RANK_KEY = "lora_max_rank"
# `WorkerInfo.extra`'s key of a worker whose engine runs `--deterministic`; its value
# says what the engine's bits depend on (`engine.determinism.numerics`: kernels, dtype,
# tensor-parallel size): workers of one value compute the same KV
DETERMINISTIC_KEY = "deterministic"


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str
    model: str
    incarnation_id: str = field(default_factory=new_incarnation_id)
    grpc_address: str = ""
    metrics_address: str = ""
    transfer: TransferInfo | None = None
    kv_layout: KvLayout | None = None
    max_model_len: int | None = None  # the context window this worker serves
    started_at: float = field(default_factory=time.time)
    extra: dict[str, Any] = field(default_factory=dict)
    # how many requests it runs at once, and queues behind them before refusing more
    # (a frontend sheds at the edge from these, before tokenizing; frontend/workers.py)
    max_running: int | None = None
    max_queued: int | None = None

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)
        check_name("role", self.role)
        for name in ("model", "incarnation_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 1 <= len(value) <= 256:
                raise InvalidInput(f"{name} must be a non-empty string (<= 256 chars)")
        for name in ("grpc_address", "metrics_address"):
            value = getattr(self, name)
            if not isinstance(value, str) or (value and not _is_host_port(value)):
                raise InvalidInput(f"{name} must be 'host:port' or empty, got {value!r}")
        m = self.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 2):
            raise InvalidInput(f"max_model_len must be an integer >= 2, got {m!r}")
        if not isinstance(self.extra, dict):
            raise InvalidInput("extra must be a JSON object")
        for name in ("max_running", "max_queued"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise InvalidInput(f"{name} must be an integer >= 0, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "worker_id": self.worker_id,
            "role": self.role,
            "incarnation_id": self.incarnation_id,
            "model": self.model,
            "grpc_address": self.grpc_address,
            "metrics_address": self.metrics_address,
            "transfer": self.transfer.to_dict() if self.transfer else None,
            "kv_layout": self.kv_layout.to_dict() if self.kv_layout else None,
            "max_model_len": self.max_model_len,
            "started_at": self.started_at,
            "extra": self.extra,
            "max_running": self.max_running,
            "max_queued": self.max_queued,
        }

    def to_json(self) -> bytes:
        data = json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()
        if len(data) > MAX_RECORD_BYTES:
            raise InvalidInput(
                f"worker record is {len(data)} bytes, over the {MAX_RECORD_BYTES}-byte limit; "
                "keep large blobs out of discovery"
            )
        return data

    @classmethod
    def from_json(cls, data: bytes | str) -> WorkerInfo:
        """Parse a record; raises :class:`InvalidInput` with the reason when malformed."""
        d = json_object(data, "worker record", MAX_RECORD_BYTES)
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise InvalidInput(
                f"worker record schema_version {version!r} is not {SCHEMA_VERSION}; "
                "workers of different Diptych versions share this namespace"
            )
        try:
            return cls(
                worker_id=d["worker_id"],
                role=d["role"],
                model=d["model"],
                incarnation_id=d["incarnation_id"],
                grpc_address=d.get("grpc_address", ""),
                metrics_address=d.get("metrics_address", ""),
                transfer=TransferInfo.from_dict(d["transfer"]) if d.get("transfer") else None,
                kv_layout=KvLayout.from_dict(d["kv_layout"]) if d.get("kv_layout") else None,
                max_model_len=d.get("max_model_len"),
                started_at=float(d.get("started_at", 0.0)),
                extra=d.get("extra") or {},
                max_running=d.get("max_running"),
                max_queued=d.get("max_queued"),
            )
        except KeyError as e:
            raise InvalidInput(f"worker record is missing {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, InvalidInput):
                raise
            raise InvalidInput(f"worker record has a field of the wrong type: {e}") from None


def _is_host_port(value: str) -> bool:
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
