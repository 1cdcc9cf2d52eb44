"""The progress bar: in-place on a terminal, a line per 10 % into a file."""

from __future__ import annotations

import io

from bench.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_into_a_file_writes_a_line_per_decile() -> None:
    out = io.StringIO()
    p = Progress(20, label="rate 2", stream=out)
    for i in range(20):
        p.update(success=i != 3)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11  # the first completion, then every 10 %
    assert lines[-1].startswith("rate 2 [" + "#" * 30 + "] 20/20 1 failed")


def test_progress_on_a_terminal_redraws_in_place() -> None:
    out = _Tty()
    p = Progress(3, stream=out)
    for _ in range(3):
        p.update()
    p.close()
    text = out.getvalue()
    assert text.startswith("\r[") and "3/3" in text and text.endswith("\n")
    assert "\n" not in text[:-1]


def test_disabled_progress_is_silent() -> None:
    out = _Tty()
    p = Progress(3, enabled=False, stream=out)
    p.update()
    p.close()
    assert out.getvalue() == "" and p.done == 1
