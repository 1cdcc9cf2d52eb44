"""The life of a request stays short, and docs/architecture.md stays true about it.

One streamed, disaggregated chat completion is traced (tests/e2e/request_path.py);
every product file whose code runs for it must be named in the "life of a request"
section of docs/architecture.md: in its numbered read-through (at most 30 files, the
decode side's control logic in at most 6) or among the files it lists as running
below that level.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e.request_path import DECODE_CONTROL, ROOT, trace

DOC = ROOT / "docs" / "architecture.md"


def _section() -> str:
    text = DOC.read_text()
    start = text.index("### The life of a request")
    end = text.index("\n## ", start)
    return text[start:end]


def read_through() -> list[str]:
    return re.findall(r"^\s*\d+\. `([^`]+)`", _section(), flags=re.M)


def also_named() -> list[str]:
    below = _section().split("Below that level", 1)[1]
    return re.findall(r"`([a-z_]+/[^`]*)`", below)


def _named(path: str, listed: list[str], also: list[str]) -> bool:
    return path in listed or any(
        path == a or (a.endswith("/") and path.startswith(a)) for a in also
    )


def test_the_read_through_is_short() -> None:
    listed = read_through()
    assert len(listed) == len(set(listed)) and 10 < len(listed) <= 30, listed
    assert len(DECODE_CONTROL) <= 6 and set(listed) >= DECODE_CONTROL
    for p in listed + [a for a in also_named() if not a.endswith("/")]:
        assert (ROOT / p).is_file(), f"docs/architecture.md names {p}, which does not exist"


def test_every_file_a_request_runs_is_in_the_doc(tmp_path: Path) -> None:
    listed, also = read_through(), also_named()
    ran = trace(tmp_path)
    missing = [p for p in ran if not _named(p, listed, also)]
    assert not missing, f"a request now runs {missing}: add them to docs/architecture.md"
    # the decode side decides nothing outside its control files
    decided = {p for p in ran if p.startswith("decode_worker/") and p in DECODE_CONTROL}
    assert decided == {"decode_worker/handler.py", "decode_worker/remote_prefill.py"}
