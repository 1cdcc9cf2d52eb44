"""A field declared once: its type (the annotation), default, range and help.

    @dataclass(frozen=True)
    class Thing:
        size: int = spec(16, lo=1, hi=1024, help="items a step")
        ratio: float = spec(0.5, lo=0.0, hi=1.0, lo_open=True)

        def __post_init__(self) -> None:
            check_fields(self)      # types and ranges, from the declarations

Readers build on the same metadata: the HTTP edge's request fields (their ranges),
command-line flags (type, default, help), and the codecs at the end of this module (to
JSON values, and to protobuf messages by field name):

    data = to_plain(params)                    # {"temperature": 0.7, ...}
    params = from_plain(SamplingParams, data)  # validated by the class's own checks
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from protocol.errors import InvalidInput

if TYPE_CHECKING:
    from google.protobuf.message import Message


MISSING: Any = dataclasses.MISSING


@dataclass(frozen=True)
class Bounds:
    """What a value may be: numbers in [lo, hi] (lo excluded with lo_open), at most
    max_items items in a sequence or mapping, strings of at most max_chars, one of
    choices."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    max_items: int | None = None
    max_chars: int | None = None
    choices: tuple[Any, ...] | None = None

    def describe(self) -> str:
        lo = "-inf" if self.lo is None else _num(self.lo)
        hi = "inf" if self.hi is None else _num(self.hi)
        return f"{'(' if self.lo_open else '['}{lo}, {hi}]"


def _num(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 2**31 - 1:
        for base, name in ((2**64, "2**64"), (2**63, "2**63"), (2**31, "2**31")):
            for off in (0, -1):
                if x == base + off:
                    return name + (" - 1" if off else "")
                if x == -(base + off):
                    return "-" + name
    return repr(x)


def spec(
    default: Any = MISSING,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    max_items: int | None = None,
    max_chars: int | None = None,
    choices: tuple[Any, ...] | None = None,
    help: str = "",
    **extra: Any,
) -> Any:
    """A dataclass field whose metadata holds its bounds, help and any `extra` keys
    (e.g. ``api=True``: a field the HTTP edge takes under the same name)."""
    meta = {
        "bounds": Bounds(lo, hi, lo_open, max_items, max_chars, choices),
        "help": help,
        **extra,
    }
    if isinstance(default, (list, dict, set)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def bounds(f: dataclasses.Field[Any]) -> Bounds:
    b = f.metadata.get("bounds")
    return b if isinstance(b, Bounds) else Bounds()


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass (cached)."""
    found = _HINTS.get(cls)
    if found is None:
        found = _HINTS[cls] = typing.get_type_hints(cls)
    return found


_PLANS: dict[type, tuple[tuple[str, Any, Bounds, Any], ...]] = {}


def _plan(cls: type) -> tuple[tuple[str, Any, Bounds, Any], ...]:
    """(name, annotation, bounds, default) of each init field of a dataclass (cached);
    the default is MISSING for fields without one or with a factory."""
    found = _PLANS.get(cls)
    if found is None:
        types_of = hints(cls)
        found = _PLANS[cls] = tuple(
            (f.name, types_of[f.name], bounds(f), f.default)
            for f in dataclasses.fields(cls)
            if f.init
        )
    return found


def check_fields(obj: Any, prefix: str = "") -> None:
    """Normalise (lists to tuples, mappings to dicts) and check every field of a frozen
    dataclass against its annotation and bounds; raises InvalidInput naming the field.
    A field that holds its declared default itself is not checked again (every default
    is checked once, by `check_defaults`): a request sets a handful of its fields."""
    for name, hint, b, default in _plan(type(obj)):
        value = getattr(obj, name)
        if value is default and default is not MISSING:
            continue
        checked = check_value(prefix + name, hint, value, b)
        if checked is not value:
            object.__setattr__(obj, name, checked)


def check_defaults(cls: type) -> None:
    """Raise InvalidInput if a declared default is outside its own declaration."""
    for name, hint, b, default in _plan(cls):
        if default is not MISSING:
            check_value(f"{cls.__name__}.{name}'s default", hint, default, b)


def check_value(name: str, hint: Any, value: Any, b: Bounds = Bounds()) -> Any:
    """`value` as `hint` says (tuples for sequences, dicts for mappings), or raise."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        rest = [o for o in options if o is not type(None)]
        if len(rest) == 1:
            return check_value(name, rest[0], value, b)
        for option in rest:  # the first shape that fits
            try:
                return check_value(name, option, value, b)
            except InvalidInput:
                continue
        raise InvalidInput(f"{name} has the wrong type: {type(value).__name__}")
    scalar = not isinstance(value, (tuple, list, dict))
    if b.choices is not None and scalar and value not in b.choices:
        raise InvalidInput(f"{name} must be one of {list(b.choices)}, got {value!r}")
    if hint is bool:
        if not isinstance(value, bool):
            raise InvalidInput(f"{name} must be a boolean, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidInput(f"{name} must be an integer, got {value!r}")
        _in_range(name, value, b)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInput(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise InvalidInput(f"{name} must be a finite number, got {value!r}")
        _in_range(name, value, b)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise InvalidInput(f"{name} must be a string, got {type(value).__name__}")
        if b.max_chars is not None and len(value) > b.max_chars:
            raise InvalidInput(f"{name} must be at most {b.max_chars} characters")
        return value
    if origin is tuple:
        args = typing.get_args(hint)
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
            raise InvalidInput(f"{name} must be a list, got {type(value).__name__}")
        items = tuple(value)
        if b.max_items is not None and len(items) > b.max_items:
            raise InvalidInput(f"{name} takes at most {b.max_items} items, got {len(items)}")
        item = Bounds(b.lo, b.hi, b.lo_open, max_chars=b.max_chars, choices=b.choices)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(check_value(f"{name}[{i}]", args[0], v, item) for i, v in enumerate(items))
        if len(items) != len(args):
            raise InvalidInput(f"{name} must have {len(args)} items, got {len(items)}")
        return tuple(check_value(f"{name}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, items)))
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if isinstance(value, Mapping):
            pairs = list(value.items())
        elif isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise InvalidInput(f"{name} must be an object, got {type(value).__name__}")
        else:
            pairs = [tuple(p) for p in value]
        if b.max_items is not None and len(pairs) > b.max_items:
            raise InvalidInput(f"{name} takes at most {b.max_items} entries, got {len(pairs)}")
        item = Bounds(b.lo, b.hi, b.lo_open, max_chars=b.max_chars)
        out = {}
        for k, v in pairs:
            if key_type is int and isinstance(k, str) and k.lstrip("-").isdigit():
                k = int(k)  # JSON's keys are strings
            key = check_value(
                f"{name} key", key_type, k, Bounds(0) if key_type is int else Bounds()
            )
            out[key] = check_value(f"{name}[{k!r}]", value_type, v, item)
        return out
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            raise InvalidInput(f"{name} must be a {hint.__name__}, got {type(value).__name__}")
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise InvalidInput(f"{name} must be a {hint.__name__}, got {type(value).__name__}")
    return value


def _in_range(name: str, value: float, b: Bounds) -> None:
    if (b.lo is not None and (value < b.lo or (b.lo_open and value == b.lo))) or (
        b.hi is not None and value > b.hi
    ):
        raise InvalidInput(f"{name} must be in {b.describe()}, got {value!r}")


# The wire codec: dataclasses to and from plain JSON values, by iterating their fields.
# Every init field is written; reading refuses a name the class does not have and
# leaves a missing one to its default, so a message written by an older peer reads.
# Nested dataclasses, tuples, dicts with int keys, enums and optionals are rebuilt from
# the annotations; anything else must be a JSON value already.

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


M = TypeVar("M", bound="Message")


# And to and from protobuf messages, field by field, by name (protobuf itself is not
# imported here: the messages come from the caller):
#
#     msg = to_pb(usage, pb.Usage)                       # every field of the dataclass
#     usage = from_pb(Usage, msg)                        # every field of the dataclass
#     msg = to_pb(req, pb.GenerateRequest, sampling=...) # a field that needs converting
#
# Each field of the dataclass must be a field of the message with the same name (a
# dataclass field the message lacks is a TypeError naming it, so a new field cannot be
# forgotten on the wire); the keyword arguments give the converted value of the fields
# that are not plain (nested messages, bytes, enums of another numbering). Repeated
# fields come back as tuples, maps as dicts, and an unset optional scalar as None. The
# dataclass's own checks validate what is decoded. A field whose metadata says
# ``local=True`` is not on the message (it travels beside it, like a call's trace context
# in the call's metadata): ``to_pb`` leaves it out and ``from_pb`` takes it from the keyword
# arguments only, else its default.


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


# -- identifiers and token ids --------------------------------------------------------------
# Worker ids, roles and namespaces end up in etcd keys, NATS subjects and stream names, so
# they are restricted to characters that are safe in all three. Request ids come from
# clients (``chatcmpl-...``) and only need to be printable ASCII, which is what NATS
# headers accept.

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")

MAX_TOKEN_ID = 2**31 - 1


def check_name(what: str, value: object) -> str:
    """A namespace or role: lower-case letters, digits, ``_`` and ``-``, at most 63 chars."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidInput(
            f"{what} must be 1-63 characters of [a-z0-9_-] starting with a letter or digit, "
            f"got {value!r}"
        )
    return value


def check_worker_id(value: object, what: str = "worker_id") -> str:
    if not isinstance(value, str) or not _WORKER_ID.fullmatch(value):
        raise InvalidInput(
            f"{what} must be 1-128 characters of [A-Za-z0-9_-] starting with a letter or "
            f"digit, got {value!r}"
        )
    return value


def check_request_id(value: object) -> str:
    if not isinstance(value, str) or not _REQUEST_ID.fullmatch(value):
        raise InvalidInput(
            f"request_id must be 1-256 printable ASCII characters without spaces, got {value!r}"
        )
    return value


def check_token_ids(what: str, ids: object, *, allow_empty: bool = False) -> tuple[int, ...]:
    """Token ids as a tuple of ints in ``[0, 2**31)``; rejects bools and other types."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise InvalidInput(f"{what} must be a sequence of token ids, got {type(ids).__name__}")
    out = tuple(ids)
    if not out:
        if allow_empty:
            return out
        raise InvalidInput(f"{what} must not be empty")
    # C-speed checks first: prompts can hold 100k+ tokens.
    if not (set(map(type, out)) == {int} and min(out) >= 0 and max(out) <= MAX_TOKEN_ID):
        for i, t in enumerate(out):
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                raise InvalidInput(f"{what}[{i}] = {t!r} is not a token id in [0, {MAX_TOKEN_ID}]")
    return out


def json_object(
    data: bytes | str, what: str, max_bytes: int, error: type[InvalidInput] = InvalidInput
) -> dict[str, Any]:
    """`data` parsed as a JSON object of at most `max_bytes`; otherwise raises `error`
    (InvalidInput or a subclass) with a reason that names `what`."""
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit")
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{what} is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise error(f"{what} must be a JSON object")
    return d
