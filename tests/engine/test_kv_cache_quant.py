"""`kv_cache_dtype="int8"` and `"fp8"` in the engine: the pool each sizes, the
concurrency a fixed KV budget then holds, and greedy agreement with the bf16 KV
cache on the parity prompts (tests/engine/corpus.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine import LLM, CompletionResult, EngineConfig, SamplingParams
from engine.request import NewRequest
from kernels import cpu_isa
from tests.conftest import REPORT
from tests.engine.corpus import parity_prompts

pytestmark = pytest.mark.slow

# Greedy agreement with the bf16 KV cache on the parity prompts (22 prompts of 1 to
# 1,500 tokens, 24 tokens each), judged by the fp32 model, not by the bf16 run: bf16 is
# itself off fp32 by up to ~10 logits at some steps. On an AMX-less AVX512-BF16 CPU
# (a Zen 5; here forced, scripts/test) the int8 cache left the bf16 one at a step where
# the bf16 run ranked its token 3.91 above int8's while fp32 ranked int8's 3.30 above:
# the bf16 run was the one far from fp32 there (10.5 logits; int8 13.1).
#
# Three measures, per ISA level (measured below; scripts/test runs this at the
# native level and forced to avx512_bf16):
# - identical: prompts whose 24 tokens all match the bf16 cache's (FULL_MATCHES).
# - error: each run's logits against the fp32 run's over the steps where their tokens
#   still agree, max over the vocabulary, averaged over steps, then prompts; the
#   quantized cache's over the bf16 cache's at most ERROR_RATIO. This is the accuracy
#   the format costs, whatever the tokens do.
# - int8 flips: at the first step where int8's token leaves bf16's, fp32 (over the
#   tokens both share) may prefer bf16's token by no more than the bf16 run's own error
#   on that margin plus NEAR_TIE: a flip is a near-tie, or a step where bf16 itself is
#   off. fp8's values keep 3 mantissa bits, and its error on the 1,024- and 1,500-token
#   prompts is 1-5 logits at every step (fp32 weights too), so a flip there is inside
#   its error: the ratio bounds fp8, not a margin.
#
# Measured on an Intel Xeon with AMX (2 vCPUs), the lower levels forced as scripts/test
# does:
#   level         int8: identical  error ratio  worst flip excess    fp8: identical  ratio
#   amx (native)        15         1.22         0.05                      11         1.99
#   avx512_bf16         13         1.22         0.11                       9         2.06
#   avx2                14         1.35         0.11                       9         2.20
#   generic             14         1.30         0.32                       10        2.02
# Each run repeats bit for bit. int8's
# error is 1.2-1.35x the bf16 cache's, fp8's about 2x: e4m3's 3 mantissa bits against
# int8's 127 even steps of the row's range. The bounds sit about a quarter above the
# worst level, and three prompts below its identical count.
ERROR_RATIO = {"int8": 1.7, "fp8": 2.8}
NEAR_TIE = {"int8": 0.6}
FULL_MATCHES = {"int8": 10, "fp8": 6}


def test_an_unknown_kv_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'int8', 'fp8'"):
        EngineConfig(kv_cache_dtype="int4")


def _peak_running(llm: LLM, n: int, prompt_len: int, out_len: int) -> int:
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    for i in range(n):
        ids = [(7 * i + j) % 5000 + 100 for j in range(prompt_len)]  # no shared prefix
        llm.engine.submit(NewRequest(f"r{i}", ids, params))
    peak = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        peak = max(peak, len(llm.engine.scheduler.running))
    return peak


@pytest.mark.parametrize(("kv", "pool_dtype"), [("int8", "int8"), ("fp8", "float8_e4m3fn")])
def test_the_same_kv_budget_holds_twice_the_sequences(
    make_llm: Callable[..., LLM], kv: str, pool_dtype: str
) -> None:
    budget = 8 << 20  # 8 MiB: 24 bf16 blocks of SmolLM2-135M, 46 int8 or fp8 ones
    bf16 = make_llm(dtype="bfloat16", kv_cache_memory_bytes=budget, enable_prefix_caching=False)
    quant = make_llm(dtype="bfloat16", kv_cache_memory_bytes=budget, enable_prefix_caching=False,
                     kv_cache_dtype=kv)  # fmt: skip
    lb, lq = bf16.engine.runner.layout, quant.engine.runner.layout
    assert (lb.dtype, lq.dtype) == ("bfloat16", pool_dtype)
    assert lq.block_bytes / lb.block_bytes == 66 / 128
    assert lq.num_blocks == budget // lq.block_bytes > 1.9 * lb.num_blocks
    paths = quant.engine.runner.kernel_paths()
    assert paths["kv_cache"] == pool_dtype
    if paths["device"] == "cpu" and paths["build"] != "none":
        assert paths["attention"] == f"generic_{kv}kv"
    # sequences of 3 blocks each (40 prompt + 8 output tokens)
    peak_bf16 = _peak_running(bf16, 16, 40, 8)
    peak_quant = _peak_running(quant, 16, 40, 8)
    assert peak_bf16 == (lb.num_blocks - 1) // 3
    assert peak_quant == (lq.num_blocks - 1) // 3 >= 1.9 * peak_bf16


_GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, output_logits=True)


@dataclass
class _References:
    judge: LLM  # the fp32 model, for teacher-forced steps
    fp32: list[CompletionResult]
    bf16: list[CompletionResult]  # bf16 weights and KV cache


@pytest.fixture(scope="module")
def references() -> _References:
    judge = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20)
    fp32 = judge.generate(parity_prompts(judge.tokenizer.encode), _GREEDY)
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=256 << 20)
    return _References(judge, fp32, llm.generate(parity_prompts(llm.tokenizer.encode), _GREEDY))


def _first_difference(a: CompletionResult, b: CompletionResult) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)


def _error(runs: list[CompletionResult], fp32: list[CompletionResult]) -> float:
    """Mean over prompts of the mean over steps (those whose context fp32 shares) of the
    largest logit difference to fp32."""
    per_prompt = []
    for run, ref in zip(runs, fp32):
        assert run.logits is not None and ref.logits is not None
        n = _first_difference(run, ref)
        steps = len(run.token_ids) if n is None else n + 1
        diffs = [float((run.logits[j] - ref.logits[j]).abs().max()) for j in range(steps)]
        per_prompt.append(sum(diffs) / len(diffs))
    return sum(per_prompt) / len(per_prompt)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_greedy_agreement_with_the_bf16_kv_cache_judged_by_fp32(
    kv: str, references: _References
) -> None:
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=256 << 20, kv_cache_dtype=kv)
    runs = llm.generate(parity_prompts(llm.tokenizer.encode), _GREEDY)
    del llm
    one = SamplingParams(max_tokens=1, temperature=0, output_logits=True)
    full, flips = 0, []
    for ref, got in zip(references.bf16, runs):
        n = _first_difference(ref, got)
        if n is None:
            full += 1
            continue
        if kv not in NEAR_TIE:
            continue
        shared = [*ref.prompt_token_ids, *ref.token_ids[:n]]
        fp32 = references.judge.generate([shared], one)[0].logits
        assert fp32 is not None and ref.logits is not None
        a, b = ref.token_ids[n], got.token_ids[n]
        fp32_margin = float(fp32[0][a] - fp32[0][b])  # > 0: fp32 sides with the bf16 cache
        bf16_error = abs(float(ref.logits[n][a] - ref.logits[n][b]) - fp32_margin)
        flips.append(fp32_margin - bf16_error)
        assert flips[-1] < NEAR_TIE[kv], (ref.prompt_token_ids[:8], n, fp32_margin, bf16_error)
    ratio = _error(runs, references.fp32) / _error(references.bf16, references.fp32)
    worst = f"; worst flip excess {max(flips):.2f}" if flips else ""
    REPORT[f"{kv} KV vs bf16 KV at ISA {cpu_isa.probe().level}"] = (
        f"{full} of {len(runs)} identical; error ratio {ratio:.2f}{worst}"
    )
    assert full >= FULL_MATCHES[kv], full
    assert ratio <= ERROR_RATIO[kv], ratio
