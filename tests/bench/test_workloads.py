"""Workloads built with the default model's tokenizer: exact lengths, shapes, files."""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.workloads import PromptBuilder, WorkloadSpec, build_workload, reseeded
from bench.workloads.synthetic import sharegpt_lengths


def test_prompts_have_exact_token_counts(builder: PromptBuilder) -> None:
    rng = random.Random(0)
    for n in (1, 2, 17, 128, 1000, 3000):
        assert builder.count(builder.text(n, rng)) == n
    assert builder.text(0, rng) == ""
    a, b = builder.text(10, rng), builder.text(20, rng)
    assert builder.count(builder.concat(a, b)) == 30


def test_random_workload_lengths_prefix_and_seed(builder: PromptBuilder) -> None:
    spec = WorkloadSpec(
        "random",
        num_prompts=40,
        input_len=100,
        output_len=20,
        range_ratio=0.5,
        prefix_len=16,
        seed=1,
    )
    reqs = build_workload(spec, builder)
    assert len(reqs) == 40
    for r in reqs:
        assert builder.count(r.prompt) == r.prompt_len
        assert 16 + 50 <= r.prompt_len <= 16 + 150
        assert 10 <= r.output_len <= 30
    assert len({r.prompt_len for r in reqs}) > 10
    shared = min(len(r.prompt) for r in reqs)
    common = 0
    while common < shared and len({r.prompt[common] for r in reqs}) == 1:
        common += 1
    assert builder.count(reqs[0].prompt[:common]) >= 15  # the 16-token prefix is shared
    assert build_workload(spec, builder) == reqs
    assert build_workload(reseeded(spec, 1), builder)[0].prompt != reqs[0].prompt
    fixed = build_workload(WorkloadSpec("random", num_prompts=3, input_len=64), builder)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(64, 128)] * 3


def test_sharegpt_like_length_mix() -> None:
    rng = random.Random(0)
    pairs = [sharegpt_lengths(rng) for _ in range(20000)]
    ins, outs = [p[0] for p in pairs], [p[1] for p in pairs]
    assert statistics.mean(ins) == pytest.approx(161, rel=0.05)
    assert statistics.mean(outs) == pytest.approx(338, rel=0.05)
    assert statistics.median(ins) < statistics.mean(ins)  # heavy right tail
    assert min(ins) >= 4 and min(outs) >= 4 and max(ins) <= 1024
    assert max(i + o for i, o in pairs) <= 2048


def test_sharegpt_workload(builder: PromptBuilder) -> None:
    reqs = build_workload(WorkloadSpec("sharegpt", num_prompts=20, seed=2), builder)
    assert all(builder.count(r.prompt) == r.prompt_len for r in reqs)
    fixed = build_workload(WorkloadSpec("sharegpt", num_prompts=5, sharegpt_output_len=7), builder)
    assert {r.output_len for r in fixed} == {7}


def test_bursty_mix(builder: PromptBuilder) -> None:
    spec = WorkloadSpec(
        "bursty",
        num_prompts=24,
        short_input_len=32,
        short_output_len=8,
        long_input_len=400,
        long_output_len=4,
        long_every=6,
    )
    reqs = build_workload(spec, builder)
    long = [i for i, r in enumerate(reqs) if r.tag == "long"]
    assert long == [5, 11, 17, 23]
    for r in reqs:
        assert builder.count(r.prompt) == r.prompt_len
        want = (400, 4) if r.tag == "long" else (32, 8)
        assert (r.prompt_len, r.output_len) == want


def test_multiturn_sessions_share_prefixes(builder: PromptBuilder) -> None:
    spec = WorkloadSpec(
        "multiturn",
        num_prompts=14,
        turns=3,
        system_len=64,
        num_systems=2,
        user_len=16,
        turn_output_len=8,
        think_time=0.5,
        seed=4,
    )
    reqs = build_workload(spec, builder)
    assert len(reqs) == 14  # 5 sessions, the last cut to 2 turns
    sessions: dict[int, list] = {}
    for r in reqs:
        assert r.session is not None and r.messages is not None
        assert builder.count(r.prompt) == r.prompt_len
        sessions.setdefault(r.session, []).append(r)
    assert [len(s) for s in sessions.values()] == [3, 3, 3, 3, 2]
    for turns in sessions.values():
        assert [t.tag for t in turns] == ["turn1", "turn2", "turn3"][: len(turns)]
        assert [t.think_time for t in turns][:2] == [0.0, 0.5]
        for a, b in itertools.pairwise(turns):
            assert b.prompt.startswith(a.prompt)  # the whole previous turn is a prefix
            assert b.prompt_len > a.prompt_len + 16 + 8
            assert len(b.messages or ()) == len(a.messages or ()) + 2
    systems = [turns[0].messages[0]["content"] for turns in sessions.values()]  # type: ignore[index]
    assert len(set(systems)) <= 2 < len(systems)  # sessions share system prompts


def test_multiturn_system_prompt_share_skews_one_prompt(builder: PromptBuilder) -> None:
    spec = WorkloadSpec("multiturn", num_prompts=400, turns=1, system_len=8, num_systems=8,
                        user_len=4, turn_output_len=2, system_share=0.5, seed=1)  # fmt: skip
    reqs = build_workload(spec, builder)
    systems = Counter(r.messages[0]["content"] for r in reqs)  # type: ignore[index]
    top, n = systems.most_common(1)[0]
    assert 0.4 < n / 400 < 0.6 and len(systems) == 8
    assert max(c for s, c in systems.items() if s != top) < 0.15 * 400
    with pytest.raises(ValueError, match="share"):
        WorkloadSpec("multiturn", system_share=1.5).validate()


def test_prompts_from_files(builder: PromptBuilder, tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "hello there", "output_tokens": 5}\n\n{"prompt": "hi"}\n')
    reqs = build_workload(
        WorkloadSpec("custom", num_prompts=2, dataset_path=str(jsonl), custom_output_len=9),
        builder,
    )
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("hello there", 2, 5),
        ("hi", 1, 9),
    ]
    txt = tmp_path / "p.txt"
    txt.write_text("one prompt\nanother prompt here\n")
    spec = WorkloadSpec("custom", num_prompts=2, dataset_path=str(txt))
    assert [r.prompt for r in build_workload(spec, builder)] == [
        "one prompt",
        "another prompt here",
    ]
    share = tmp_path / "sg.json"
    long_reply = "word " * 50
    conv = [
        {
            "conversations": [
                {"from": "human", "value": f"question number {i} please"},
                {"from": "gpt", "value": long_reply},
            ]
        }
        for i in range(6)
    ]
    conv.append({"conversations": [{"from": "human", "value": "hi"}]})  # no reply: skipped
    share.write_text(json.dumps(conv))
    reqs = build_workload(WorkloadSpec("sharegpt", num_prompts=4, dataset_path=str(share)), builder)
    assert len(reqs) == 4 and all(r.output_len == builder.count(long_reply) for r in reqs)


def test_file_errors(builder: PromptBuilder, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        build_workload(WorkloadSpec("custom", dataset_path=str(tmp_path / "none.jsonl")), builder)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match='"prompt"'):
        build_workload(WorkloadSpec("custom", num_prompts=1, dataset_path=str(bad)), builder)
    short = tmp_path / "short.txt"
    short.write_text("only one\n")
    with pytest.raises(ValueError, match="fewer than --num-prompts"):
        build_workload(WorkloadSpec("custom", num_prompts=3, dataset_path=str(short)), builder)
    with pytest.raises(ValueError, match="dataset-path"):
        build_workload(WorkloadSpec("custom"), builder)
    with pytest.raises(ValueError, match="unknown dataset"):
        build_workload(WorkloadSpec("sonnet"), builder)


def test_chat_prompts_use_the_models_template(builder: PromptBuilder) -> None:
    text = builder.render_chat([{"role": "user", "content": "hello"}])
    assert "hello" in text and text.rstrip().endswith("assistant")  # SmolLM2's ChatML


def test_bench_imports_nothing_of_diptych() -> None:
    """bench/ reaches servers over HTTP only (ARCHITECTURE.md): not even the tokenizer."""
    code = (
        "import sys\n"
        "from bench import build_parser, run_benchmark\n"
        "from bench.workloads import PromptBuilder, load_tokenizer\n"
        "PromptBuilder(load_tokenizer(None))\n"
        "ours = {'engine', 'kernels', 'transfer', 'runtime', 'frontend', 'decode_worker',\n"
        "        'prefill_worker', 'planner', 'diptych'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & ours))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_agentic_sessions_grow_by_outputs_and_tool_results(builder: PromptBuilder) -> None:
    spec = WorkloadSpec("agentic", num_prompts=40, turns=4, system_len=32, num_systems=2,
                        user_len=16, turn_output_len=8, tool_len=40, tool_latency=2.0,
                        seed=3)  # fmt: skip
    reqs = build_workload(spec, builder)
    assert len(reqs) == 40
    sessions: dict[int, list] = {}
    for r in reqs:
        assert r.session is not None and builder.count(r.prompt) == r.prompt_len
        sessions.setdefault(r.session, []).append(r)
    tools, waits = [], []
    for turns in sessions.values():
        assert [t.tag for t in turns] == ["turn1", "turn2", "turn3", "turn4"]
        assert turns[0].think_time == 0.0
        for a, b in itertools.pairwise(turns):
            assert b.prompt.startswith(a.prompt)  # the previous turn is all a prefix
            assert len(b.messages or ()) == len(a.messages or ()) + 2
            tools.append(b.prompt_len - a.prompt_len)
            waits.append(b.think_time)
    assert len(set(tools)) > 5  # tool results of many lengths
    assert 1.0 < sum(waits) / len(waits) < 3.5 and min(waits) >= 0.0  # mean 2 s
    assert build_workload(spec, builder) == reqs  # the same for the same seed
    with pytest.raises(ValueError, match="agentic-tool-len"):
        WorkloadSpec("agentic", tool_len=0).validate()
