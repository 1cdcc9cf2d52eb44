"""Prefill and decode at different tensor-parallel sizes, both directions, on real
processes: `diptych serve` with one prefill worker at TP p and one decode worker at
TP d (each a worker process and its rank processes), a tiny random Llama (8 heads, 4
KV heads) with SmolLM2's tokenizer, fp32 greedy, every prompt prefilled remotely.

Each prefill rank writes the KV heads it holds straight into the decode ranks that
hold them (split when d > p, gathered from several prefill ranks when d < p): the
streamed text through the official openai client is the aggregated TP 1 engine's,
the prefill worker's per-rank counters show each rank wrote only into the decode
ranks holding its heads, and the decode worker's blocks are back to idle."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from protocol.kv_layout import KvLayout, head_slices
from tests.e2e.serving import STREAM_PROMPTS, Server, greedy_streams, offline_greedy_chats
from tests.e2e.test_tp_rank_kill import tiny_llama

pytestmark = pytest.mark.slow

PROMPTS = STREAM_PROMPTS[:2]
MAX_TOKENS = 24
HEADS = 4  # the tiny Llama's KV heads


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def aggregated(model: Path) -> list[str]:
    """Each prompt's greedy text from the engine at TP 1, aggregated (in process)."""
    return offline_greedy_chats(model, PROMPTS, MAX_TOKENS)


def _expected_pairs(prefill_tp: int, decode_tp: int) -> set[tuple[int, int]]:
    base = KvLayout(1, 2, 16, HEADS, 8, "float32", "m")

    def split(tp: int) -> KvLayout:
        share = max(1, HEADS // tp)
        return dataclasses.replace(base, num_kv_heads=share, tp_size=tp, model_kv_heads=HEADS)

    return {(s.src_rank, s.dst_rank) for s in head_slices(split(prefill_tp), split(decode_tp))}


@pytest.fixture(
    params=[(1, 2), (2, 1), (2, 4), (4, 2)], ids=lambda t: f"prefill{t[0]}-decode{t[1]}"
)
def fleet(
    request: pytest.FixtureRequest, model: Path, tmp_path: Path
) -> Iterator[tuple[Server, int, int]]:
    prefill_tp, decode_tp = request.param
    server = Server(
        tmp_path,
        "--model", str(model), "--dtype", "float32", "--num-blocks", "256",
        "--tensor-parallel-size", str(decode_tp),
        "--prefill-tensor-parallel-size", str(prefill_tp),
        "--prefill-workers", "1", "--decode-workers", "1",
        "--min-remote-prefill-tokens", "1", "--no-prefill-affinity",
    )  # fmt: skip
    yield server, prefill_tp, decode_tp
    assert server.stop() == 0


def test_streams_match_aggregated_tp1_whatever_the_two_splits(
    fleet: tuple[Server, int, int], aggregated: list[str]
) -> None:
    server, prefill_tp, decode_tp = fleet
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert greedy_streams(client, PROMPTS, MAX_TOKENS) == aggregated

    decode = server.metrics("decode-0")
    assert decode['diptych_worker_remote_prefills_finished_total{result="ok"}'] == len(PROMPTS)
    assert decode["diptych_worker_tensor_parallel_size"] == decode_tp
    assert decode["diptych_worker_kv_used_blocks"] == 0.0
    prefill = server.metrics("prefill-0")
    assert prefill["diptych_worker_tensor_parallel_size"] == prefill_tp
    sent = {
        (int(k.split('prefill_rank="')[1][0]), int(k.split('decode_rank="')[1][0])): v
        for k, v in prefill.items()
        if k.startswith("diptych_transfer_rank_sent_bytes_total{")
    }
    assert set(sent) == _expected_pairs(prefill_tp, decode_tp)
    assert all(v > 0 for v in sent.values())
    assert sum(sent.values()) == prefill["diptych_transfer_sent_bytes_total"]
