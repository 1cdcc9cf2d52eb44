"""Suite-wide pytest setup: GPU skipping, and a summary of reported measurements."""

from __future__ import annotations

import pytest
import torch

import kernels  # noqa: F401  (applies DIPTYCH_CPU_ISA to ATen and oneDNN before any op)

# label -> value; tests record figures here (e.g. max logits difference) for the summary
REPORT: dict[str, str] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if REPORT:
        terminalreporter.section("measurements reported by tests")
        for k, v in sorted(REPORT.items()):
            terminalreporter.write_line(f"{k}: {v}")
