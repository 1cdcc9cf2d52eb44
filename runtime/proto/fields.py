"""Dataclasses to and from protobuf messages, field by field, by name.

    msg = to_pb(usage, pb.Usage)                       # every field of the dataclass
    usage = from_pb(Usage, msg)                        # every field of the dataclass
    msg = to_pb(req, pb.GenerateRequest, sampling=...) # a field that needs converting

Each field of the dataclass must be a field of the message with the same name (a
dataclass field the message lacks is a TypeError naming it, so a new field cannot be
forgotten on the wire); the keyword arguments give the converted value of the fields
that are not plain (nested messages, bytes, enums of another numbering). Repeated
fields come back as tuples, maps as dicts, and an unset optional scalar as None. The
dataclass's own checks validate what is decoded. A field whose metadata says
``local=True`` is not on the message (it travels beside it, like a call's trace context
in the call's metadata): ``to_pb`` leaves it out and ``from_pb`` takes it from the keyword
arguments only, else its default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from google.protobuf.message import Message

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def to_pb(obj: object, message: type[M], **converted: object) -> M:
    names = message.DESCRIPTOR.fields_by_name
    values: dict[str, Any] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if not f.init or f.metadata.get("local"):
            continue
        if f.name not in names:
            raise TypeError(f"{message.DESCRIPTOR.name} has no field {f.name!r}")
        values[f.name] = converted[f.name] if f.name in converted else getattr(obj, f.name)
    for name, value in converted.items():
        if name not in values:
            values[name] = value  # a field of the message alone (a schema version)
    return message(**values)


def from_pb(cls: type[T], msg: Message, **converted: object) -> T:
    names = msg.DESCRIPTOR.fields_by_name
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        if f.name in converted:
            values[f.name] = converted[f.name]
            continue
        if f.metadata.get("local"):
            continue
        d = names.get(f.name)
        if d is None:
            raise TypeError(f"{msg.DESCRIPTOR.name} has no field {f.name!r}")
        value = getattr(msg, f.name)
        if d.message_type is not None and d.message_type.GetOptions().map_entry:
            value = dict(value)
        elif _repeated(d):
            value = tuple(value)
        elif d.has_presence and d.message_type is None and not msg.HasField(f.name):
            value = None
        values[f.name] = value
    return cls(**values)


def _repeated(d: Any) -> bool:
    """protobuf 7 says `is_repeated`; older releases, the label."""
    flag = getattr(d, "is_repeated", None)
    return bool(flag) if flag is not None else bool(d.label == d.LABEL_REPEATED)
