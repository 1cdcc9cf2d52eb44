"""Write one `### ...` subsection of a `## ...` section of docs/benchmarks.md in place.

The subsection is found by the start of its heading line; it runs to the next `### `
or `## ` heading. If it is absent it is appended at the end of the section, after
whatever the section already holds, so other subsections are never touched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def _next_heading(doc: str, start: int, prefixes: tuple[str, ...]) -> int:
    pos = start
    while True:
        nl = doc.find("\n", pos)
        if nl < 0:
            return len(doc)
        line_start = nl + 1
        if doc.startswith(prefixes, line_start):
            return line_start
        pos = line_start


def write_subsection(
    heading: str, body: str, section: str = "## Serving", path: Path = DOCS
) -> None:
    """Replace (or append) the subsection starting with `heading` inside `section`."""
    if not heading.startswith("### "):
        raise ValueError("heading must be a '### ' line")
    doc = path.read_text()
    try:
        sec = doc.index(section + "\n")
    except ValueError:
        raise ValueError(f"{path} has no {section!r} section") from None
    sec_end = _next_heading(doc, sec, ("## ",))
    text = heading + "\n\n" + body.strip() + "\n"
    found = doc.find("\n" + heading, sec, sec_end)
    if found >= 0:
        start = found + 1
        end = _next_heading(doc, start, ("### ", "## "))
        new = doc[:start] + text + ("\n" if end < len(doc) else "") + doc[end:]
    else:
        head = doc[:sec_end].rstrip("\n") + "\n\n"
        tail = doc[sec_end:]
        new = head + text + ("\n" + tail if tail else "")
    path.write_text(new)


def write_section(heading: str, body: str, path: Path = DOCS, after: str | None = None) -> None:
    """Replace the `## ` section starting with `heading` (to the next `## ` heading); if
    absent, insert it before the section that follows `after`, else at the end."""
    if not heading.startswith("## "):
        raise ValueError("heading must be a '## ' line")
    doc = path.read_text()
    text = heading + "\n\n" + body.strip() + "\n"
    found = doc.find(heading + "\n") if doc.startswith(heading + "\n") else -1
    if found < 0:
        at = doc.find("\n" + heading + "\n")
        found = at + 1 if at >= 0 else -1
    if found >= 0:
        end = _next_heading(doc, found, ("## ",))
        new = doc[:found] + text + ("\n" if end < len(doc) else "") + doc[end:]
    else:
        anchor = doc.find("\n" + after + "\n") if after else -1
        if anchor >= 0:
            at = _next_heading(doc, anchor + 1, ("## ",))
            new = doc[:at] + text + ("\n" if at < len(doc) else "") + doc[at:]
        else:
            new = doc.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def publish(doc: dict[str, Any], out: Path, table: str, heading: str, section: str,
            docs: bool) -> None:  # fmt: skip
    """A benchmark's ending: its JSON to `out`, its table printed, and with `docs` the
    table as docs/benchmarks.md's subsection `heading` of `section`."""
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(table)
    if docs:
        write_subsection(heading, table, section=section)
