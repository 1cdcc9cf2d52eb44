"""A mixture-of-experts model served disaggregated on real processes: `diptych serve`
with one prefill and one decode worker, a tiny random Qwen3-MoE (8 experts, the top 2
renormalized, one dense layer) with SmolLM2's tokenizer, fp32 greedy, every prompt
prefilled remotely. The streamed text through the official openai client is the
aggregated engine's, and the decode worker's blocks are back to idle. (The experts
change the MLP, not the KV cache: the handoff is a dense model's; tests/engine's
tiny-checkpoint tests hold each MoE family to HF transformers.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.serving import STREAM_PROMPTS, Server, greedy_streams, offline_greedy_chats
from tests.e2e.test_tp_rank_kill import tiny_model

pytestmark = pytest.mark.slow

PROMPTS = STREAM_PROMPTS[:3]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-moe"), "Qwen3MoeConfig",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def aggregated(model: Path) -> list[str]:
    return offline_greedy_chats(model, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def fleet(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tmp_path_factory.mktemp("moe-serve"),
        "--model", str(model), "--dtype", "float32", "--num-blocks", "256",
        "--prefill-workers", "1", "--decode-workers", "1",
        "--min-remote-prefill-tokens", "1", "--no-prefill-affinity",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def test_disaggregated_streams_equal_the_aggregated_engine(
    fleet: Server, aggregated: list[str]
) -> None:
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert greedy_streams(client, PROMPTS, MAX_TOKENS) == aggregated
    assert len(set(aggregated)) == len(PROMPTS)  # the prompts lead somewhere different
    decode = fleet.metrics("decode-0")
    assert decode['diptych_worker_remote_prefills_finished_total{result="ok"}'] == len(PROMPTS)
    assert decode["diptych_worker_kv_used_blocks"] == 0.0
