"""The dependency direction of docs/architecture.md, checked on every import of every
product package: arrows only point down, and a package imports only what its row of
the table allows (every package may import the leaf package `protocol`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# package -> the internal packages it may import (besides itself and `protocol`)
MAY_IMPORT: dict[str, set[str]] = {
    "protocol": set(),
    "kernels": set(),
    "transfer": set(),
    "runtime": set(),
    "bench": set(),  # HTTP only
    "engine": {"kernels"},
    "planner": {"runtime"},
    "frontend": {"runtime", "engine"},  # the engine's tokenizer side only, below
    "worker": {"engine", "transfer", "runtime"},
    "decode_worker": {"worker", "engine", "transfer", "runtime"},
    "prefill_worker": {"worker", "engine", "transfer", "runtime"},
    "diptych": set(),  # the top floor: everything
}
INTERNAL = set(MAY_IMPORT)
# what of the engine the frontend loads: text in and out, grammars to compile, and the
# thinking count (so a request's reasoning tokens are counted as the engine counts them)
FRONTEND_ENGINE = {"engine.tokenizer", "engine.grammar", "engine.reasoning"}


def imports(package: str) -> list[tuple[str, str]]:
    """(file, imported module) for every absolute import of an internal package."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            rel = path.relative_to(ROOT).as_posix()
            out += [(rel, n) for n in names if n.split(".")[0] in INTERNAL]
    return out


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_point_down(package: str) -> None:
    if package == "diptych":
        return
    allowed = MAY_IMPORT[package] | {package, "protocol"}
    wrong = [(f, m) for f, m in imports(package) if m.split(".")[0] not in allowed]
    if package == "frontend":
        wrong += [(f, m) for f, m in imports(package)
                  if m.startswith("engine") and m not in FRONTEND_ENGINE]  # fmt: skip
    assert not wrong, f"{package} imports what its row does not allow: {wrong}"


def test_only_the_top_floor_imports_a_role() -> None:
    roles = ("decode_worker", "prefill_worker", "frontend", "planner")
    for package in MAY_IMPORT:
        if package == "diptych":
            continue
        for f, m in imports(package):
            top = m.split(".")[0]
            assert (
                top not in roles
                or top == package
                or (package in ("decode_worker", "prefill_worker") and top == "worker")
            ), f"{f} imports the role {m}"
