"""Declared defaults are inside their own declarations: check_fields skips a field that
holds its default, so a default out of range would slip through unchecked."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import pytest

from protocol.declare import check_defaults, check_fields

PACKAGES = ("protocol", "engine", "runtime", "frontend", "worker", "decode_worker",
            "prefill_worker", "planner", "diptych")  # fmt: skip


def _declared() -> list[type]:
    """Every dataclass of the product packages whose fields carry declarations."""
    found: dict[str, type] = {}
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        for info in pkgutil.walk_packages(pkg.__path__, name + "."):
            if ".sim.data" in info.name or info.name.endswith("__main__"):
                continue
            try:
                mod = importlib.import_module(info.name)
            except ImportError:  # optional backends (ray, nixl, ...)
                continue
            for obj in vars(mod).values():
                if (isinstance(obj, type) and dataclasses.is_dataclass(obj)
                        and obj.__module__ == mod.__name__
                        and any("bounds" in f.metadata for f in dataclasses.fields(obj))):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj  # fmt: skip
    return list(found.values())


DECLARED = _declared()


def test_the_declared_classes_are_found() -> None:
    names = {c.__name__ for c in DECLARED}
    assert {"SamplingParams", "EngineConfig", "FrontendConfig", "PlanSettings"} <= names


@pytest.mark.parametrize("cls", DECLARED, ids=lambda c: c.__name__)
def test_every_default_is_inside_its_declaration(cls: type) -> None:
    check_defaults(cls)


def test_a_value_equal_to_but_not_the_default_is_still_checked() -> None:
    from protocol.errors import InvalidInput
    from protocol.sampling import SamplingParams

    p = SamplingParams(temperature=0.7)
    object.__setattr__(p, "temperature", 9.0)
    with pytest.raises(InvalidInput, match="temperature"):
        check_fields(p)
