"""Mixture-of-experts models served disaggregated on real processes: `diptych serve`
with one prefill and one decode worker, fp32 greedy, every prompt prefilled remotely,
SmolLM2's tokenizer on tiny random models: a Qwen3-MoE (8 experts, the top 2
renormalized, one dense layer; its KV handoff is a dense model's) and a DeepSeek-V3
(multi-head latent attention: the transfer moves latent blocks, one row of
kv_lora_rank + rotary values a token and layer; a dense first layer, then a sigmoid
router over 8 experts in groups beside a shared expert). The streamed text through
the official openai client is the aggregated engine's, the bytes received are whole
blocks of the layout the decode worker published, and its blocks are back to idle.
(tests/engine's tiny-checkpoint tests hold each family to HF transformers.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine.weights import load_model_config
from tests.conftest import REPORT
from tests.e2e.serving import STREAM_PROMPTS, Server, greedy_streams, offline_greedy_chats
from tests.e2e.test_tp_rank_kill import tiny_model

pytestmark = pytest.mark.slow

PROMPTS = STREAM_PROMPTS[:3]
MAX_TOKENS = 24


MODELS = {
    "qwen3-moe": ("Qwen3MoeConfig", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": [1], "tie_word_embeddings": False,
    }),
    "deepseek-v3-mla": ("DeepseekV3Config", {
        "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
        "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 32,
        "first_k_dense_replace": 1, "tie_word_embeddings": False,
    }),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config, extra = MODELS[request.param]
    return tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), config, **extra)


@pytest.fixture(scope="module")
def aggregated(model: Path) -> list[str]:
    return offline_greedy_chats(model, PROMPTS, MAX_TOKENS)


# the DeepSeek fleet's decode worker spreads its experts over two ranks (tokens sent to
# them by all-to-all) while its prefill worker runs on one: the latent, whole on every
# rank, goes to both
PARALLEL = {"deepseek_v3": ("--tensor-parallel-size", "2", "--expert-parallel-size", "2",
                                "--prefill-tensor-parallel-size", "1")}  # fmt: skip


@pytest.fixture(scope="module")
def fleet(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tmp_path_factory.mktemp("moe-serve"),
        "--model", str(model), "--dtype", "float32", "--num-blocks", "256",
        "--prefill-workers", "1", "--decode-workers", "1",
        "--min-remote-prefill-tokens", "1", "--no-prefill-affinity",
        *PARALLEL.get(load_model_config(model).architecture, ()),
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def test_disaggregated_streams_equal_the_aggregated_engine(
    fleet: Server, aggregated: list[str], model: Path
) -> None:
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert greedy_streams(client, PROMPTS, MAX_TOKENS) == aggregated
    assert len(set(aggregated)) == len(PROMPTS)  # the prompts lead somewhere different
    decode = fleet.metrics("decode-0")
    assert decode['diptych_worker_remote_prefills_finished_total{result="ok"}'] == len(PROMPTS)
    assert decode["diptych_worker_kv_used_blocks"] == 0.0
    # decode steps route a token or a few: their busiest expert well above an even share
    assert decode["diptych_worker_moe_steps_total"] >= MAX_TOKENS - 1
    assert decode["diptych_worker_moe_expert_load_imbalance_mean"] > 1.0
    mc = load_model_config(model)
    # a block: every layer's K and V planes (MLA: the latent plane alone) of 16 slots
    block = mc.num_hidden_layers * mc.kv_planes * 16 * mc.kv_cache_heads * mc.kv_cache_dim * 4
    received = decode["diptych_transfer_received_bytes_total"]
    assert received > 0 and received % block == 0
    REPORT[f"tiny {mc.architecture}: KV bytes a block hands over (fp32, 2 layers)"] = f"{block}"
    a2a = decode["diptych_worker_moe_all_to_all_bytes_total"]
    if decode["diptych_worker_tensor_parallel_size"] > 1:  # the experts spread: tokens sent
        assert a2a > 0
        REPORT[f"tiny {mc.architecture} at EP 2: all-to-all bytes a decode step, rank 0"] = (
            f"{a2a / decode['diptych_worker_moe_steps_total']:.0f}"
        )
    else:
        assert a2a == 0
