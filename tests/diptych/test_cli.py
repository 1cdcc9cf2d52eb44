"""The `diptych` command line, run as a user would."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diptych.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_generate_raw_matches_engine() -> None:
    prompt = "The capital of France is"
    proc = _run("generate", "--raw", prompt, "--max-tokens", "8", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    expected = LLM(dtype="float32").generate(prompt, SamplingParams(temperature=0, max_tokens=8))
    assert proc.stdout.strip() == expected[0].text.strip()
    assert "prompt +" in proc.stderr and "tok/s" in proc.stderr


@pytest.mark.slow
def test_chat_session_from_stdin() -> None:
    proc = _run("chat", "--max-tokens", "8", stdin="Hello!\n/reset\nWhat is 2+2?\n/exit\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("output tokens") == 2


def test_bad_arguments_give_clear_errors() -> None:
    proc = _run("generate", "hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert "argument --temperature: must be in [0.0, 2.0], got -1.0" in proc.stderr
    proc = _run("generate", "hi", "--model", "/nonexistent/model.gguf")
    assert proc.returncode == 2 and "not found" in proc.stderr
    assert _run("--help").returncode == 0


def test_every_valued_flag_shows_its_default() -> None:
    """--help says each flag's default: the declaration's, in the flag's unit, or the
    command's own (switches are off unless given, which their names say)."""
    from diptych.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("serve", "decode", "prefill", "frontend", "generate"):
        for action in sub.choices[name]._actions:
            switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
            if action.option_strings and not switch and action.dest != "help":
                assert "default" in (action.help or ""), (name, action.option_strings)
    serve = {a.dest: a.help for a in sub.choices["serve"]._actions}
    assert serve["max_num_seqs"].endswith("(default: 128)")
    assert serve["kv_cache_memory"].endswith("(default: 1)")  # GiB, the flag's unit
    assert serve["ttft_slo_ms"].endswith("(default: 2000)")  # ms, the flag's unit
