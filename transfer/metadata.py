"""Agent metadata: the self-contained description a peer needs to talk to us.

Published in discovery (etcd) as bytes (`to_bytes`) or embedded in a larger
JSON document (`to_dict`). It names the agent and its incarnation, carries the
agent's secret (peers prove they know the secret of the metadata they were
added with), the transports it serves, its regions with their sizes and an
optional layout hash the caller checks (`Agent.add_remote(expect_layout=...)`).

Example (tcp agent with one 1 MiB region)::

    {"v": 1, "name": "decode-0", "incarnation": "5f0c...", "secret": "9a1e...",
     "backends": ["tcp"], "layout": "c3ab...", "host": "node-7",
     "shm_domain": null,
     "transports": {"tcp": {"host": "10.0.0.7", "port": 41231}},
     "regions": [{"id": 0, "nbytes": 1048576, "device": "cpu"}]}

The metadata changes when regions are registered or removed: register the KV
pool first, then publish.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from transfer.errors import MetadataError

VERSION = 1
KINDS = ("nixl", "ucx", "shm", "tcp")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_MAX_NAME = 256


def local_shm_domain(shm_dir: str) -> str:
    """Two agents with the same domain can map each other's segments and reach
    each other's abstract Unix sockets: same boot, same tmpfs, same network
    namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    st = os.stat(shm_dir)
    return f"{boot}:{st.st_dev}:{st.st_ino}:{netns}"


@dataclass(frozen=True)
class RegionInfo:
    id: int
    nbytes: int
    device: str = "cpu"
    shm: str | None = None
    address: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "nbytes": self.nbytes, "device": self.device}
        if self.shm is not None:
            d["shm"] = self.shm
        if self.address is not None:
            d["address"] = self.address
        return d


@dataclass(frozen=True)
class AgentMetadata:
    name: str
    incarnation: str
    secret: bytes
    backends: tuple[str, ...]
    transports: dict[str, dict[str, Any]]
    regions: tuple[RegionInfo, ...]
    layout: str | None = None
    host: str = ""
    shm_domain: str | None = None
    sizes: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = np.full(max((r.id for r in self.regions), default=-1) + 1, -1, dtype=np.int64)
        for r in self.regions:
            sizes[r.id] = r.nbytes
        sizes.flags.writeable = False
        object.__setattr__(self, "sizes", sizes)

    def region(self, rid: int) -> RegionInfo:
        for r in self.regions:
            if r.id == rid:
                return r
        raise KeyError(rid)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "name": self.name,
            "incarnation": self.incarnation,
            "secret": self.secret.hex(),
            "backends": list(self.backends),
            "layout": self.layout,
            "host": self.host,
            "shm_domain": self.shm_domain,
            "transports": self.transports,
            "regions": [r.to_dict() for r in self.regions],
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> AgentMetadata:
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise MetadataError(f"agent metadata is not JSON: {e}") from None
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: Any) -> AgentMetadata:
        if not isinstance(d, dict):
            raise MetadataError("agent metadata must be a JSON object")
        if d.get("v") != VERSION:
            raise MetadataError(f"unsupported agent metadata version {d.get('v')!r}")
        name = _get(d, "name", str)
        if not 0 < len(name) <= _MAX_NAME:
            raise MetadataError(f"agent name must have 1..{_MAX_NAME} characters")
        incarnation = _get(d, "incarnation", str)
        if not _HEX32.match(incarnation):
            raise MetadataError("incarnation must be 32 lowercase hex digits")
        try:
            secret = bytes.fromhex(_get(d, "secret", str))
        except ValueError:
            raise MetadataError("secret must be hex") from None
        if len(secret) < 16:
            raise MetadataError("secret must have at least 16 bytes")
        backends = tuple(_get(d, "backends", list))
        if not backends or any(b not in KINDS for b in backends):
            raise MetadataError(f"backends must be a non-empty subset of {KINDS}, got {backends}")
        transports = _get(d, "transports", dict)
        if any(k not in transports or not isinstance(transports[k], dict) for k in backends):
            raise MetadataError("every listed backend needs an entry in transports")
        regions = tuple(_region(r) for r in _get(d, "regions", list))
        if len({r.id for r in regions}) != len(regions):
            raise MetadataError("region ids must be unique")
        layout = d.get("layout")
        shm_domain = d.get("shm_domain")
        if not isinstance(layout, (str, type(None))) or not isinstance(
            shm_domain, (str, type(None))
        ):
            raise MetadataError("layout and shm_domain must be strings or null")
        return cls(
            name=name,
            incarnation=incarnation,
            secret=secret,
            backends=backends,
            transports=transports,
            regions=regions,
            layout=layout,
            host=str(d.get("host", "")),
            shm_domain=shm_domain,
        )


def _get(d: dict[str, Any], key: str, typ: type) -> Any:
    v = d.get(key)
    if not isinstance(v, typ) or isinstance(v, bool):
        raise MetadataError(f"metadata field {key!r} must be a {typ.__name__}")
    return v


def _region(r: Any) -> RegionInfo:
    if not isinstance(r, dict):
        raise MetadataError("each region must be an object")
    rid, nbytes = _get(r, "id", int), _get(r, "nbytes", int)
    if rid < 0 or rid > 1 << 20 or nbytes <= 0:
        raise MetadataError(f"bad region id {rid} or size {nbytes}")
    shm, address = r.get("shm"), r.get("address")
    if not isinstance(shm, (str, type(None))) or not isinstance(address, (int, type(None))):
        raise MetadataError("region shm must be a string and address an integer")
    return RegionInfo(rid, nbytes, str(r.get("device", "cpu")), shm, address)
