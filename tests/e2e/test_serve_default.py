"""The README's main command, `diptych serve` on its defaults (`--dtype auto`, shm, one
prefill and one decode worker), on this CPU's ISA level: scripts/test runs it natively
and again with the level forced to the first level below (every worker takes the forced
level; the kernels of each level are tested on their own at every level).

Greedy text through the official openai client equals the offline engine's on the
same level and dtype, for a prompt prefilled remotely and one prefilled locally, and
every worker exports the kernel paths it chose.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from engine import LLM, SamplingParams
from kernels import cpu_isa, cpu_ops
from tests.e2e.serving import Server

pytestmark = pytest.mark.slow

LONG = (
    "A lighthouse keeper writes in her log every night: the weather, the ships that "
    "passed, the state of the lamp. Tonight the sea is calm, two fishing boats came "
    "home late, and the lens needed cleaning twice. Write her next entry:"
)
SHORT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # defaults but a smaller KV pool and a remote-prefill threshold the long prompt passes
    s = Server(
        tmp_path_factory.mktemp("serve-default"),
        "--kv-cache-memory", "0.25", "--min-remote-prefill-tokens", "32",
    )  # fmt: skip
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(num_blocks=256)  # dtype auto, as the workers


def _info(server: Server, child: str) -> dict[str, str]:
    """The labels of a worker's diptych_worker_kernels_info sample."""
    for key in server.metrics(child):
        if key.startswith("diptych_worker_kernels_info{"):
            pairs = key[key.index("{") + 1 : -1].split('",')
            return dict(p.rstrip('"').split('="', 1) for p in pairs)
    raise AssertionError(f"{child} exports no diptych_worker_kernels_info")


def test_workers_report_the_level_and_dtype_auto_chose(server: Server) -> None:
    isa = cpu_isa.probe()
    dtype = str(cpu_ops.auto_dtype()).removeprefix("torch.")
    for child in ("decode-0", "prefill-0"):
        info = _info(server, child)
        assert info["isa_level"] == isa.level and info["isa_native"] == isa.native
        assert info["build"] == cpu_ops.cpu_build().level
        assert info["dtype"] == dtype
        assert info["gemm"] == cpu_ops.dispatch_report(torch.bfloat16)["gemm"]
    assert any(line.startswith(f"Kernels: CPU {isa.model}") for line in server.log)


def test_the_start_up_says_what_it_does_and_how_long_it_took(server: Server) -> None:
    """Progress lines for each stage of each role (a cold start takes minutes), whatever
    the log level: kernels built or loaded, weights, KV pool, ready; then serve's own."""
    log = "".join(server.log)
    for child in ("decode-0", "prefill-0"):
        for stage in (f"[{child}] C++ CPU kernels ({cpu_ops.cpu_build().level}): ",
                      f"[{child}] weights: ", f"[{child}] KV pool: ",
                      f"[{child}] {child.split('-')[0]} ready "):  # fmt: skip
            assert stage in log, stage
    assert "[frontend] frontend ready " in log
    assert re.search(r"Diptych is serving .*; ready in \d+ s\)\.", log)


def test_greedy_text_equals_the_offline_engine(
    server: Server, offline: LLM, tmp_path: Path
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    before = server.metrics("decode-0")
    for prompt in (LONG, SHORT):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].text
        assert out.choices[0].text == want
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    parts = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    ids = offline.tokenizer.apply_chat_template(messages)
    assert streamed == offline.generate([ids], SamplingParams(temperature=0, max_tokens=16))[0].text
    after = server.metrics("decode-0")
    for where, n in (("remote", 2), ("local", 1)):  # the long prompt and the chat; the short
        key = f'diptych_worker_requests_total{{prefill="{where}"}}'
        assert after[key] - before.get(key, 0) == n, where
