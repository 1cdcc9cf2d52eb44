"""The life of a request stays short, and docs/architecture.md stays true about it.

One streamed, disaggregated chat completion is traced (tests/e2e/request_path.py); the
"life of a request" section of docs/architecture.md must name exactly the product files
whose code runs for it, each by its path (no folder stands for its files): the numbered
read-through and the list below it. The count is printed and held to a bound.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPORT
from tests.e2e.request_path import DECODE_CONTROL, ROOT, trace

DOC = ROOT / "docs" / "architecture.md"
# the files one traced request runs, at most; a file added to the
# path raises the count and fails here until the doc and this bound say so
MAX_FILES = 45  # issue 35's goal (80 when it was filed): see the doc


def _section() -> str:
    text = DOC.read_text()
    start = text.index("### The life of a request")
    end = text.index("\n### ", start + 1)
    return text[start:end]


def read_through() -> list[str]:
    return re.findall(r"^\s*\d+\. `([^`]+)`", _section(), flags=re.M)


def _below() -> str:
    """The list under "Below that level" (the prose after it may name files off the
    path: those a request with other options runs)."""
    return _section().split("Below that level", 1)[1].split("\n\n")[1]


def also_named() -> list[str]:
    return re.findall(r"`([a-z_]+/[a-z_/]+\.py)`", _below())


def test_the_doc_names_files_not_folders() -> None:
    listed, also = read_through(), also_named()
    assert len(listed) == len(set(listed)), "a file is numbered twice"
    assert not set(listed) & set(also), set(listed) & set(also)
    for p in listed + also:
        assert (ROOT / p).is_file(), f"docs/architecture.md names {p}, which does not exist"
    folders = re.findall(r"`([a-z_]+/(?:[a-z_]+/)*)`", _below())
    assert not folders, f"folders stand for their files: {folders}"


def test_the_doc_names_exactly_the_files_a_request_runs(tmp_path: Path) -> None:
    listed, also = read_through(), also_named()
    ran = trace(tmp_path)
    REPORT["product files one streamed disaggregated chat runs"] = str(len(ran))
    named = set(listed) | set(also)
    missing = [p for p in ran if p not in named]
    assert not missing, f"a request now runs {missing}: add them to docs/architecture.md"
    stale = sorted(named - set(ran))
    assert not stale, f"docs/architecture.md names {stale}, which the request does not run"
    assert len(ran) <= MAX_FILES, f"{len(ran)} files on the path, more than {MAX_FILES}"
    # the decode side decides things only in its control files, all of them on the path
    assert set(ran) >= DECODE_CONTROL
    starred = {p for p in listed if re.search(rf"`{re.escape(p)}` ★", _section())}
    assert starred == DECODE_CONTROL, starred ^ DECODE_CONTROL
