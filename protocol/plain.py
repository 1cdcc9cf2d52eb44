"""Dataclasses to and from plain JSON values, by iterating their fields.

    data = to_plain(params)                  # {"temperature": 0.7, ...}
    params = from_plain(SamplingParams, data)  # validated by the class's own checks

Every init field is written; reading refuses a name the class does not have and
leaves a missing one to its default, so a message written by an older peer reads.
Nested dataclasses, tuples, dicts with int keys, enums and optionals are rebuilt from
the annotations; anything else must be a JSON value already.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from protocol.declare import hints
from protocol.errors import InvalidInput

T = TypeVar("T")


def to_plain(value: Any, other: Callable[[Any], Any] | None = None) -> Any:
    """`value` as JSON values; `other` converts what this does not know (else TypeError)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_plain(getattr(value, f.name), other)
            for f in dataclasses.fields(value)
            if f.init
        }
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple, frozenset, set)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [to_plain(v, other) for v in items]
    if isinstance(value, dict):
        return {str(k): to_plain(v, other) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if other is not None:
        return other(value)
    raise TypeError(f"cannot write a {type(value).__name__} as JSON")


def from_plain(cls: type[T], data: Any, what: str = "") -> T:
    """An instance of the dataclass `cls` from `to_plain`'s output; InvalidInput (or the
    class's own ValueError) says what is wrong."""
    name = what or cls.__name__
    if not isinstance(data, dict):
        raise InvalidInput(f"{name} must be an object, got {type(data).__name__}")
    types_of = hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = set(data) - fields
    if unknown:
        raise InvalidInput(f"{name} has no field(s) {sorted(unknown)}")
    kwargs = {k: _value(types_of[k], v, f"{name}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def _value(hint: Any, value: Any, what: str) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            if option is type(None):
                continue
            if _fits(option, value):
                return _value(option, value, what)
        return value  # the class's own checks name what is wrong
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return from_plain(hint, value, what)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise InvalidInput(f"{what}: {value!r} is not a {hint.__name__}") from None
    if origin in (tuple, frozenset) and isinstance(value, list):
        args = typing.get_args(hint)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return tuple(_value(a, v, what) for a, v in zip(args, value))
        return origin(_value(args[0], v, what) for v in value)
    if origin is dict and isinstance(value, dict):
        key_type, value_type = typing.get_args(hint)
        out = {}
        for k, v in value.items():
            if key_type is int:
                try:
                    k = int(k)
                except ValueError:
                    raise InvalidInput(f"{what}: key {k!r} is not an integer") from None
            out[k] = _value(value_type, v, what)
        return out
    return value


def _fits(option: Any, value: Any) -> bool:
    origin = typing.get_origin(option) or option
    if isinstance(option, type) and dataclasses.is_dataclass(option):
        return isinstance(value, dict)
    if origin in (tuple, frozenset, list):
        return isinstance(value, list)
    if origin is dict:
        return isinstance(value, dict)
    return True


def dumps(value: Any) -> bytes:
    """Compact JSON bytes of `to_plain(value)`."""
    return json.dumps(to_plain(value), separators=(",", ":")).encode()


def loads(cls: type[T], data: bytes | str, what: str = "") -> T:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidInput(f"{what or cls.__name__} is not JSON: {e}") from None
    return from_plain(cls, doc, what)
