"""A role's typed config as the launcher hands it to its child process.

`diptych serve` builds each child's config once (`DecodeWorkerConfig`,
`PrefillWorkerConfig`, `FrontendConfig`) and writes it as JSON; the child
(`python -m diptych.roles <file>`) rebuilds the same dataclass, whose own checks
validate it again. Flags are parsed in one place (`diptych.options`) and never
re-encoded as a command line.

    {"version": 1, "role": "decode", "verbose": false, "config": {... the fields ...}}

The codec is `protocol.declare`, the one that carries sampling parameters: fields by
name, rebuilt from the annotations, validated by each class's own checks.
"""

from __future__ import annotations

import json

from decode_worker.config import DecodeWorkerConfig
from frontend.config import FrontendConfig
from planner.config import PlannerConfig
from prefill_worker.config import PrefillWorkerConfig
from protocol.declare import from_plain, to_plain

VERSION = 1
RoleConfig = DecodeWorkerConfig | PrefillWorkerConfig | FrontendConfig | PlannerConfig
ROLES: dict[str, type[RoleConfig]] = {
    "decode": DecodeWorkerConfig,
    "prefill": PrefillWorkerConfig,
    "frontend": FrontendConfig,
    "planner": PlannerConfig,
}


def dumps(role: str, config: RoleConfig, *, verbose: bool = False) -> str:
    cls = ROLES.get(role)
    if cls is None or type(config) is not cls:
        raise TypeError(f"a {role} child takes a {cls and cls.__name__}, not {config!r}")
    doc = {"version": VERSION, "role": role, "verbose": verbose, "config": to_plain(config)}
    return json.dumps(doc, indent=1)


def loads(text: str) -> tuple[str, RoleConfig, bool]:
    """(role, config, verbose) from `dumps`' output; ValueError says what is wrong."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} role config")
    role = doc.get("role")
    cls = ROLES.get(role) if isinstance(role, str) else None
    if cls is None or not isinstance(role, str):
        raise ValueError(f"unknown role {role!r}")
    return role, from_plain(cls, doc.get("config")), bool(doc.get("verbose"))
