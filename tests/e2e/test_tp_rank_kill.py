"""One rank of a tensor-parallel decode worker SIGKILLed under four streams, on real
processes: `diptych serve` with two decode workers at TP 2 (each a worker process and
one rank process, gloo on the loopback), a tiny random Llama (8 heads, 4 KV heads) with
SmolLM2's tokenizer, fp32 greedy. The worker whose rank died stops (it leaves discovery
and exits), every stream completes with the text of an unbroken run (the frontend
migrated those on the dead worker) through the official openai client, none hangs, and
the survivor's blocks are back to idle."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from tests.e2e.serving import (
    STREAM_PROMPTS,
    Server,
    greedy_stream,
    idle_metrics,
    scrape,
    streams_through_a_kill,
)

pytestmark = pytest.mark.slow

PROMPTS = STREAM_PROMPTS
MAX_TOKENS = 96


def tiny_llama(path: Path) -> Path:
    """A 2-layer Llama of random weights (8 query heads, 4 KV heads) that speaks
    SmolLM2's tokenizer, saved as an HF directory."""
    return tiny_model(path, "LlamaConfig", tie_word_embeddings=False)


def tiny_model(path: Path, config: str, **extra: object) -> Path:
    """A 2-layer model of random weights (8 query heads, 4 KV heads) of the transformers
    config class named `config` (`extra` on top) that speaks SmolLM2's tokenizer,
    saved as an HF directory."""
    import transformers

    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(None).hf_tokenizer
    tok.save_pretrained(path)
    cfg = getattr(transformers, config)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        rms_norm_eps=1e-6, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    server = Server(
        tmp_path_factory.mktemp("tp-kill"),
        "--model", str(model), "--dtype", "float32", "--tensor-parallel-size", "2",
        "--prefill-workers", "0", "--decode-workers", "2",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def _ranks_of(pid: int) -> list[int]:
    """The tensor-parallel rank processes a worker process started."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"engine.parallel.ranks" in cmd:
            out.append(int(entry.name))
    return out


def test_a_killed_rank_takes_its_worker_down_and_the_streams_move(fleet: Server) -> None:
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=300)
    unbroken = [greedy_stream(client, p, MAX_TOKENS, [0], 0) for p in PROMPTS]
    assert all(f == "length" for _, f in unbroken)
    worker = fleet.manifest["decode-0"]["pid"]
    (rank,) = _ranks_of(worker)
    results = streams_through_a_kill(
        client, PROMPTS, MAX_TOKENS, lambda: os.kill(rank, signal.SIGKILL), under_way=4,
        server=fleet,
    )
    assert results == unbroken, [r if isinstance(r, BaseException) else r[1] for r in results]

    end = time.monotonic() + 60  # the worker stopped (it left discovery first) and exited
    while time.monotonic() < end and Path(f"/proc/{worker}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{worker}").exists(), "the worker whose rank died still runs"
    front = scrape(fleet.url)
    assert front['diptych_frontend_failovers_total{kind="migration"}'] >= 1
    assert front["diptych_frontend_stream_errors_total"] == 0
    survivor = idle_metrics(fleet, "decode-1")
    assert survivor["diptych_worker_kv_used_blocks"] == 0.0
    assert survivor["diptych_worker_tensor_parallel_size"] == 2.0
    assert survivor["diptych_worker_tp_collectives_total"] > 0  # what the split costs, exported
    assert survivor["diptych_worker_tp_collective_seconds_total"] > 0
    assert survivor["diptych_worker_tp_collective_bytes_total"] > 0
