"""Suite-wide pytest setup: async tests, GPU skipping, and a summary of reported measurements.

The one rule for async code in tests: write the test as ``async def test_...``. Each runs
under its own ``asyncio.run`` (see ``pytest_pyfunc_call``), with a timeout of
``ASYNC_TEST_TIMEOUT`` seconds unless the function sets an ``async_timeout`` attribute.
Fixtures stay synchronous. Only a module- or session-scoped fixture whose async servers
must outlive one test keeps them on a ``tests.loop_thread.LoopThread``; a test wraps
``asyncio.run`` itself only in a script it runs as a child process.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch

import kernels  # noqa: F401  (applies DIPTYCH_CPU_ISA to ATen and oneDNN before any op)

# label -> value; tests record figures here (e.g. max logits difference) for the summary.
# Under pytest-xdist each worker's figures travel to the controller with the report of
# the test that made them (`_report_figures`, `pytest_runtest_logreport`).
REPORT: dict[str, str] = {}
_SENT: dict[str, str] = {}

ASYNC_TEST_TIMEOUT = 120.0


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    fn = pyfuncitem.obj
    if not inspect.iscoroutinefunction(fn):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    timeout = getattr(fn, "async_timeout", ASYNC_TEST_TIMEOUT)
    asyncio.run(asyncio.wait_for(fn(**kwargs), timeout))
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Attach the figures recorded since the last report to this one."""
    report = yield
    new = {k: v for k, v in REPORT.items() if _SENT.get(k) != v}
    if new:
        _SENT.update(new)
        report.user_properties.extend(("diptych-report", kv) for kv in new.items())
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the controller (or a run without workers): collect the attached figures."""
    for name, value in report.user_properties:
        if name == "diptych-report":
            k, v = value
            REPORT[k] = v


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if REPORT:
        terminalreporter.section("measurements reported by tests")
        for k, v in sorted(REPORT.items()):
            terminalreporter.write_line(f"{k}: {v}")
