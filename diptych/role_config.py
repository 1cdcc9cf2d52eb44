"""A role's typed config as the launcher hands it to its child process.

`diptych serve` builds each child's config once (`DecodeWorkerConfig`,
`PrefillWorkerConfig`, `FrontendConfig`) and writes it as JSON; the child
(`python -m diptych.roles <file>`) rebuilds the same dataclass, whose own checks
validate it again. Flags are parsed in one place (`diptych.options`) and never
re-encoded as a command line.

    {"version": 1, "role": "decode", "verbose": false, "config": {... the fields ...}}

A stdlib-dataclass codec rather than pydantic: the configs are plain dataclasses
shared with code that must not depend on pydantic (the engine), and the only types
that need care are nested dataclasses, tuples and `torch.dtype`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

VERSION = 1


def _roles() -> dict[str, type]:
    from decode_worker.config import DecodeWorkerConfig
    from frontend.config import FrontendConfig
    from planner.config import PlannerConfig
    from prefill_worker.config import PrefillWorkerConfig

    return {
        "decode": DecodeWorkerConfig,
        "prefill": PrefillWorkerConfig,
        "frontend": FrontendConfig,
        "planner": PlannerConfig,
    }


def dumps(role: str, config: Any, *, verbose: bool = False) -> str:
    if type(config) is not _roles().get(role):
        raise TypeError(f"a {role} child takes a {_roles()[role].__name__}, not {config!r}")
    doc = {"version": VERSION, "role": role, "verbose": verbose, "config": _plain(config)}
    return json.dumps(doc, indent=1)


def loads(text: str) -> tuple[str, Any, bool]:
    """(role, config, verbose) from `dumps`' output; ValueError says what is wrong."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} role config")
    role = doc.get("role")
    cls = _roles().get(role) if isinstance(role, str) else None
    if cls is None or not isinstance(role, str):
        raise ValueError(f"unknown role {role!r}")
    return role, _build(cls, doc.get("config")), bool(doc.get("verbose"))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    raise TypeError(f"cannot pass a {type(value).__name__} to a child process")


def _build(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__} must be an object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**{k: _value(hints[k], v) for k, v in data.items()})


def _value(hint: Any, value: Any) -> Any:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    for option in options:
        is_config = isinstance(option, type) and dataclasses.is_dataclass(option)
        if is_config and isinstance(value, dict):
            return _build(option, value)
        if typing.get_origin(option) is tuple and isinstance(value, list):
            return tuple(value)
    return value
