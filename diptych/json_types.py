"""The JSON documents `diptych` writes and reads (`serve.json`, a simulated run's
results), as types: what `json.dumps` takes, each container read-only so that any
dict or list of JSON values is one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

JsonValue: TypeAlias = (
    "Mapping[str, JsonValue] | Sequence[JsonValue] | str | int | float | bool | None"
)
JsonObject: TypeAlias = dict[str, JsonValue]  # a document being built
