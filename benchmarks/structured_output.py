"""Structured output's cost: does a constrained request slow its unconstrained neighbours?

In one run on one engine (the default model, fp32): decode steps of a batch of
unconstrained requests alone, and of the same batch size where half the requests are
JSON-schema constrained, interleaved over several rounds (the machine is noisy); the
per-token mask time of the grammar engine (filled on its background thread) and how
long the sampler waited for it; and the nested schema of the test suite at temperature
1.2 over 50 seeds, checked with jsonschema.

    python benchmarks/structured_output.py [--batch 8] [--tokens 48] [--rounds 3] [--write-docs]

With xgrammar importable (``pip install xgrammar``), its per-token mask time on the same
schema and vocabulary is measured beside llguidance's, with random logits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.docs_section import write_subsection
from benchmarks.machine import cpu_isa, cpu_name
from engine import LLM, SamplingParams
from engine.grammar import GrammarState
from engine.request import NewRequest
from frontend.structured import json_schema_grammar

# Long enough that no constrained request ends before the unconstrained ones.
LONG_SCHEMA = {
    "type": "array",
    "items": {"type": "string", "maxLength": 12},
    "minItems": 40,
    "maxItems": 60,
}


WHY = (
    "- The engine: llguidance. xgrammar's masks are faster here, but in a 20-sample "
    "random-logits run on this vocabulary it let raw control characters into JSON strings "
    "(invalid JSON) and it needs triton at install; llguidance has no dependencies, "
    "produced valid JSON every time, reads Lark and GBNF grammars, and its masks are filled "
    "while the forward pass runs, so their cost does not reach the step (the sampler's wait "
    "above). outlines-core was not measured: it builds an index per schema ahead of time."
)


class Timers:
    """Time GrammarState's background fills and the sampler's waits for them."""

    def __init__(self) -> None:
        self.fills: list[float] = []
        self.waits: list[float] = []
        fill, mask = GrammarState._fill, GrammarState.mask

        def timed_fill(state: GrammarState) -> None:
            t = time.perf_counter()
            fill(state)
            self.fills.append(time.perf_counter() - t)

        def timed_mask(state: GrammarState) -> torch.Tensor:
            t = time.perf_counter()
            out = mask(state)
            self.waits.append(time.perf_counter() - t)
            return out

        GrammarState._fill = timed_fill  # type: ignore[method-assign]
        GrammarState.mask = timed_mask  # type: ignore[method-assign]


def decode_steps(llm: LLM, batch: int, constrained: int, tokens: int, grammar: str) -> list[float]:
    """Step times while all `batch` requests decode (the prefill step excluded)."""
    engine = llm.engine
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List words, as a JSON array of strings."}],
        add_generation_prompt=True,
    )
    for i in range(batch):
        params = SamplingParams(
            temperature=0.8, seed=i, max_tokens=tokens, ignore_eos=True,
            grammar=grammar if i < constrained else None,
        )  # fmt: skip
        engine.submit(NewRequest(f"b{time.monotonic_ns()}-{i}", prompt, params))
    times = []
    first = True
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        if not first and len(outs) == batch and not any(o.finished for o in outs):
            times.append(dt)
        first = False
    return times


def validity(llm: LLM, seeds: int) -> tuple[int, int]:
    import jsonschema

    from tests.engine.test_grammar import NESTED_SCHEMA

    grammar = json_schema_grammar(NESTED_SCHEMA)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a fictional person as JSON."}],
        add_generation_prompt=True,
    )
    params = [
        SamplingParams(temperature=1.2, seed=s, max_tokens=256, grammar=grammar)
        for s in range(seeds)
    ]
    ok = 0
    for out in llm.generate([prompt] * seeds, params):
        try:
            jsonschema.validate(json.loads(out.text), NESTED_SCHEMA)
            ok += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return ok, seeds


def xgrammar_mask_us(llm: LLM, schema: dict[str, Any], tokens: int = 600) -> float | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    vocab = llm.tokenizer.vocab_size
    info = xgr.TokenizerInfo.from_huggingface(llm.tokenizer.hf_tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), strict_mode=True, any_whitespace=False
    )
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    gen = torch.Generator().manual_seed(0)
    times = []
    matcher = xgr.GrammarMatcher(compiled)
    while len(times) < tokens:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t)
        logits = torch.randn(1, vocab, generator=gen)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1))
        matcher.accept_token(token)
        if matcher.is_terminated():
            matcher = xgr.GrammarMatcher(compiled)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    llm = LLM(dtype="float32", num_blocks=1024)
    grammar = json_schema_grammar(LONG_SCHEMA)
    _ = llm.engine.grammar_compiler().tokenizer  # built before timing (once per process)
    decode_steps(llm, 2, 1, 8, grammar)  # warm-up
    timers = Timers()
    alone: list[float] = []
    mixed: list[float] = []
    half: list[float] = []
    for _ in range(args.rounds):
        alone += decode_steps(llm, args.batch, 0, args.tokens, grammar)
        mixed += decode_steps(llm, args.batch, args.batch // 2, args.tokens, grammar)
        half += decode_steps(llm, args.batch // 2, 0, args.tokens, grammar)
    ok, seeds = validity(llm, args.seeds)
    xgr = xgrammar_mask_us(llm, LONG_SCHEMA)

    def ms(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    def us(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e6

    ratio = ms(mixed) / ms(alone)
    rows = [
        f"| batch of {args.batch}, decode step (TPOT) | median | steps |",
        "|---|---|---|",
        f"| unconstrained alone | {ms(alone):.1f} ms | {len(alone)} |",
        f"| half JSON-schema constrained | {ms(mixed):.1f} ms ({ratio:.3f}x) | {len(mixed)} |",
        f"| (for reference: the {args.batch // 2} unconstrained requests as a batch of their "
        f"own) | {ms(half):.1f} ms | {len(half)} |",
    ]
    mask = [
        f"- llguidance mask per token (background thread): p50 {us(timers.fills, 0.5):.0f} µs, "
        f"p99 {us(timers.fills, 0.99):.0f} µs over {len(timers.fills)} masks; the sampler waited "
        f"p50 {us(timers.waits, 0.5):.0f} µs, p99 {us(timers.waits, 0.99):.0f} µs for it",
        f"- nested schema (objects, bounded arrays, enums, integer ranges) at temperature 1.2: "
        f"{ok}/{seeds} seeds parse and validate (jsonschema)",
    ]
    if xgr is not None:
        mask.append(f"- xgrammar mask per token, same schema, random logits: p50 {xgr:.0f} µs")
    machine = f"CPU: {cpu_name()}, {cpu_isa()}, torch threads {torch.get_num_threads()}."
    body = "\n".join(
        [
            "`python benchmarks/structured_output.py --write-docs` (default model, fp32; "
            f"{args.rounds} interleaved rounds of {args.tokens} tokens; {machine}) The same "
            "batch size with and without constrained members, so the difference is what the "
            "grammars cost the step every member waits for (each request's TPOT).",
            "",
            *rows,
            "",
            *mask,
            WHY,
        ]
    )
    print(body)
    if args.write_docs:
        write_subsection("### Structured output", body, section="## OpenAI API")


if __name__ == "__main__":
    main()
