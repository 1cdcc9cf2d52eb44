"""Command-line flags generated from the config dataclasses, where each is declared once.

A config field declared with ``help`` (`protocol.declare.spec`) is a flag: its name is
the field's with dashes (or the ``flag`` given), its type the annotation's, its
default the field's (shown in ``--help``), its choices and range the declaration's.
``scale`` converts the flag's unit to the field's (``--kv-cache-memory`` GiB to
bytes). A bool field is a switch: ``--name`` when its default is False, ``--no-...``
(its ``flag``) when it is True.

    add_flags(parser, EngineConfig, "engine")
    ...
    config = build(EngineConfig, args)   # from only the flags given

A flag that is not given leaves its attribute unset in the parsed namespace
(``argparse.SUPPRESS``), so the field keeps the default its class declares; several
configs may share a flag (`diptych serve`'s ``--drain-timeout``), each taking it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypedDict, TypeVar

from protocol.declare import Bounds, bounds, check_value, hints
from protocol.errors import InvalidInput

MISSING: object = dataclasses.MISSING
T = TypeVar("T")

_WHAT: dict[object, str] = {int: "an integer", float: "a number"}
_METAVARS: dict[object, str] = {int: "N", float: "X"}


@dataclass(frozen=True)
class Flag:
    """One field of a config as a command-line flag."""

    field: str
    name: str  # "--kv-cache-memory"
    kind: Callable[[str], object]  # of the flag's value: int, float, str or bool
    default: object  # the field's (MISSING: none)
    help: str
    bounds: Bounds
    scale: float | None = None  # the field's value is the flag's times this
    many: bool = False  # a tuple field: the flag may repeat
    metavar: str | None = None  # its value's name in --help (default: from its type)

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def shown_default(self) -> object:
        """The default in the flag's unit."""
        if self.scale is not None and isinstance(self.default, (int, float)):
            return self.default / self.scale
        return self.default

    def value(self, given: object) -> object:
        """The field's value for the flag's."""
        if self.kind is bool:
            return not self.default if given else self.default
        if self.scale is not None and given is not None:
            if not isinstance(given, (int, float)):
                raise TypeError(f"{self.name} takes a number, not {given!r}")
            scaled = given * self.scale
            return round(scaled) if isinstance(self.default, int) else scaled
        if self.many:
            if not isinstance(given, Iterable):
                raise TypeError(f"{self.name} takes a sequence, not {given!r}")
            return tuple(given)
        return given


def flags(cls: type) -> Iterator[Flag]:
    """The declared flags of a config class, in field order."""
    types_of = hints(cls)
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help")
        if not text or not f.init:
            continue
        hint = _plain_type(types_of[f.name])
        many = typing.get_origin(hint) is tuple
        kind = typing.get_args(hint)[0] if many else hint
        default: object = f.default
        factory = f.default_factory
        if default is MISSING and callable(factory):
            default = factory()
        scale = f.metadata.get("scale")
        kind = float if scale is not None else kind  # a flag in other units: any number
        if not callable(kind):
            raise TypeError(f"{cls.__name__}.{f.name}: {kind!r} cannot parse a flag")
        name = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
        if kind is bool and (default is True) != name.startswith("--no-"):
            raise TypeError(f"{cls.__name__}.{f.name}: a switch defaulting to {default} "
                            f"cannot be named {name}")  # fmt: skip
        yield Flag(f.name, name, kind, default, text, bounds(f), scale, many,
                   f.metadata.get("metavar"))  # fmt: skip


def _plain_type(hint: object) -> object:
    """`int | None` -> int; `str | tuple[str, ...]` -> str."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return options[0]
    return hint


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    defaults: dict[str, object] | None = None,
) -> None:
    """Add `cls`'s flags to `parser` (those of the fields in `only`, if given), but for
    the fields in `skip` and the flags the parser has already (another config's of the
    same name: both take it). `defaults` are this command's own defaults for some
    fields, in the flags' units: always passed, and shown in the help."""
    taken = _taken(parser)
    for flag in flags(cls):
        if flag.field in skip or flag.name in taken or (only and flag.field not in only):
            continue
        own = (defaults or {}).get(flag.field, argparse.SUPPRESS)
        shown = flag.shown_default if own is argparse.SUPPRESS else own
        kwargs: _Argument = {"dest": flag.dest, "default": own}
        if flag.kind is bool:
            kwargs["action"] = "store_true"
            text = flag.help
        else:
            kwargs["type"] = _parser(flag)
            kwargs["metavar"] = _metavar(flag)
            if flag.many:
                kwargs["action"] = "append"
            if flag.bounds.choices is not None:
                kwargs["choices"] = [c for c in flag.bounds.choices if c is not None]
                kwargs.pop("metavar")
            # a help that words its default itself keeps its words
            text = flag.help
            if "default" not in text:
                text += f" (default: {_shown(shown)})"
        parser.add_argument(flag.name, help=text.replace("%", "%%"), **kwargs)


class _Argument(TypedDict, total=False):
    """What `add_flags` passes to `add_argument` besides the name and help."""

    dest: str
    default: object
    action: str
    type: Callable[[str], object]
    metavar: str
    choices: list[object]


def show_defaults(group: argparse._ArgumentGroup) -> None:
    """Append its default to the help of each hand-written valued flag of `group` that
    does not word it (the flags add_flags makes do)."""
    for action in group._group_actions:
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        text = action.help or ""
        if switch or "default" in text or action.default is argparse.SUPPRESS:
            continue
        shown = _shown(
            tuple(action.default) if isinstance(action.default, list) else action.default
        )
        action.help = f"{text} (default: {shown})".lstrip().replace("%", "%%")


def _parser(flag: Flag) -> Callable[[str], object]:
    """The flag's text as its value, checked against the field's range (in the flag's
    unit), so that argparse names the flag in its error."""
    b, scale = flag.bounds, flag.scale
    unit = b if scale is None else Bounds(
        None if b.lo is None else b.lo / scale, None if b.hi is None else b.hi / scale,
        b.lo_open, max_chars=b.max_chars,
    )  # fmt: skip

    def parse(text: str) -> object:
        try:
            value = flag.kind(text)
        except ValueError:
            what = _WHAT.get(flag.kind, "a value")
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        try:
            check_value("", flag.kind, value, unit)
        except InvalidInput as e:
            raise argparse.ArgumentTypeError(str(e).strip()) from None
        return value

    return parse


def _taken(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> set[str]:
    actions = parser._actions  # a group shares its parser's list
    return {option for a in actions for option in a.option_strings}


def _metavar(flag: Flag) -> str:
    return flag.metavar or _METAVARS.get(flag.kind, flag.dest.upper())


def _shown(value: object) -> str:
    if value is None or value is MISSING:
        return "none"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def given(cls: type, args: argparse.Namespace) -> dict[str, object]:
    """`cls`'s fields whose flags are in `args` (given on the command line), as the
    field's values."""
    out: dict[str, object] = {}
    for flag in flags(cls):
        if hasattr(args, flag.dest):
            out[flag.field] = flag.value(getattr(args, flag.dest))
    return out


def build(cls: type[T], args: argparse.Namespace, **fixed: object) -> T:
    """A `cls` of the flags given in `args` (the others keep the field's default) and
    the `fixed` fields."""
    return construct(cls, given(cls, args), **fixed)


def construct(cls: type[T], fields: Mapping[str, object], **fixed: object) -> T:
    """A `cls` of `fields` (flag values, as `given` returns them) and the `fixed`
    fields; the class's own checks validate them."""
    return cls(**fields, **fixed)


def flag_value(args: argparse.Namespace, cls: type, field: str) -> object:
    """The field's value from `args`, or its declared default when the flag is not
    given."""
    for flag in flags(cls):
        if flag.field == field:
            given = hasattr(args, flag.dest)
            return flag.value(getattr(args, flag.dest)) if given else flag.default
    raise KeyError(f"{cls.__name__} declares no flag for {field!r}")
