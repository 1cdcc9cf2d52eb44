"""What tensor parallelism costs a step on this machine: TP 1 against TP 2 on the same
cores, and rank 0's time in the collectives (all-reduces, the vocabulary gather).

A synthetic Llama of random weights (hidden 1024, 16 heads over 8 KV heads, MLP 2816,
8 layers, a 32000-token vocabulary: about 130M parameters) in fp32, so that nothing is
downloaded; a decode batch of `--batch` sequences after a 128-token prompt each. TP 1
runs with all of `--cores` threads, TP N with cores / N threads a rank: the same
cores split, so the difference is what the split costs or saves.

    python -m benchmarks.tp_step                 # prints a table, writes JSON
    python -m benchmarks.tp_step --docs          # and the docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.docs_section import publish
from benchmarks.machine import commit, cpu_isa, cpu_name, load
from engine import EngineConfig, EngineCore, NewRequest, SamplingParams

SHAPE: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
PROMPT, DECODE = 128, 48


def checkpoint(path: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SHAPE))
    model.save_pretrained(path)
    return path


def measure(
    path: Path, tp: int, cores: int, batch: int, vocab: int = SHAPE["vocab_size"], **engine: Any
) -> dict[str, Any]:
    """A decode step's median time at TP `tp` (`engine`: more EngineConfig fields), rank
    0's collectives a step (count, time, bytes; of which all-to-all), and the tokens."""
    config = EngineConfig(
        model=str(path), dtype="float32", tensor_parallel_size=tp, threads=max(1, cores // tp),
        num_blocks=batch * (PROMPT + DECODE) // 16 + 8, max_num_seqs=batch,
        max_num_batched_tokens=batch * PROMPT, **engine,
    )  # fmt: skip
    core = EngineCore(config)
    try:
        g = torch.Generator().manual_seed(1)
        params = SamplingParams(temperature=0, max_tokens=DECODE, ignore_eos=True)
        for i in range(batch):
            ids = torch.randint(0, vocab, (PROMPT,), generator=g).tolist()
            core.submit(NewRequest(str(i), ids, params))
        group = core.ranks.group if core.ranks is not None else None
        steps: list[float] = []
        collective: list[float] = []
        moved: list[tuple[int, int]] = []  # a decode step's bytes: all collectives, all-to-all
        tokens: dict[str, list[int]] = {str(i): [] for i in range(batch)}
        first = True
        while core.has_unfinished_requests():
            before = (group.collective_s, group.collectives, group.collective_bytes,
                      group.all_to_all_bytes) if group else (0.0, 0, 0, 0)  # fmt: skip
            began = time.perf_counter()
            for o in core.step():
                tokens[o.request_id] += o.new_token_ids
            took = time.perf_counter() - began
            if first:  # the prefill step
                first = False
                continue
            steps.append(took)
            if group is not None:
                collective.append(group.collective_s - before[0])
                per_step = group.collectives - before[1]
                moved.append((group.collective_bytes - before[2],
                              group.all_to_all_bytes - before[3]))  # fmt: skip
        step = statistics.median(steps)
        out: dict[str, Any] = {"tp": tp, "threads_per_rank": config.threads,
                               "decode_step_ms": round(step * 1e3, 2),
                               "tokens": [tokens[str(i)] for i in range(batch)]}  # fmt: skip
        if collective:
            c = statistics.median(collective)
            out |= {"collective_ms": round(c * 1e3, 2), "collectives_per_step": per_step,
                    "collective_share": round(c / step, 3),
                    "collective_bytes_per_step": round(statistics.mean(b for b, _ in moved)),
                    "all_to_all_bytes_per_step": round(statistics.mean(a for _, a in moved))}
        return out
    finally:
        core.close()


def _allreduce_loop(
    rank: int, store_path: str, shape: tuple[int, int], out: Any, shm: bool
) -> None:
    import torch._C._distributed_c10d as c10d

    from engine.config import ModelConfig
    from engine.parallel.group import TpGroup
    from engine.parallel.shard import TpShard

    torch.set_num_threads(1)
    mc = ModelConfig(architecture="llama", vocab_size=32000, hidden_size=shape[1],
                     intermediate_size=2816, num_hidden_layers=1, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4,
                     max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
    seg = (Path(store_path + ".shm"), 4 * shape[0] * shape[1]) if shm else None
    group = TpGroup(TpShard(mc, rank, 2), c10d.FileStore(store_path, 2), torch.device("cpu"),
                    shm=seg)  # fmt: skip
    t = torch.randn(shape)
    for _ in range(20):
        group.all_reduce(t)
    n, began = 500, time.perf_counter()
    for _ in range(n):
        group.all_reduce(t)
    if rank == 0:
        out.put((time.perf_counter() - began) / n)
    group.close()


def allreduce_us(batch: int, shm: bool) -> float:
    """One all-reduce of a decode step's hidden states [batch, 1024] fp32 between two
    idle processes: the transport alone, no rank waiting on another's compute; through
    gloo, or through shared memory (`shm`, what CPU ranks use)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        store = str(Path("/dev/shm" if shm else d) / f"store-{os.getpid()}-{shm}")
        procs = [ctx.Process(target=_allreduce_loop, args=(r, store, (batch, 1024), out, shm))
                 for r in range(2)]  # fmt: skip
        for p in procs:
            p.start()
        took = float(out.get(timeout=300))
        for p in procs:
            p.join(60)
    return took * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, default=Path("tp_step.json"))
    ap.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = checkpoint(Path(d) / "llama")
        rows = [measure(path, tp, args.cores, args.batch) for tp in args.tp]
    for r in rows:
        del r["tokens"]
    doc = {"cpu": cpu_name(), "isa": cpu_isa(), "cores": args.cores, "batch": args.batch,
           "model": SHAPE, "commit": commit(), "load": load(), "rows": rows,
           "allreduce_us": {"gloo": round(allreduce_us(args.batch, False), 1),
                            "shm": round(allreduce_us(args.batch, True), 1)}}  # fmt: skip
    publish(doc, args.out, _table(doc), "### Tensor parallelism: what the split costs a CPU step",
            "## Engine", args.docs)  # fmt: skip


def _table(doc: dict[str, Any]) -> str:
    base = doc["rows"][0]["decode_step_ms"]
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} on {doc['cpu']} ({doc['isa']}), "
        f"{doc['cores']} cores in all, commit {doc['commit']}: a synthetic Llama (hidden 1024, "
        f"16 heads / 8 KV heads, 8 layers, vocabulary 32000, about 130M parameters) in fp32, a "
        f"decode batch of {doc['batch']} after {PROMPT}-token prompts; median of "
        f"{DECODE - 1} decode steps. TP N runs N rank processes with cores / N threads "
        "each (collectives through shared memory); the collectives are rank 0's two all-reduces a "
        "layer, the embedding's and the logits' gather.",
        "",
        "| TP | threads a rank | decode step | vs TP 1 | collectives a step | their time "
        "| share of the step |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in doc["rows"]:
        lines.append(
            f"| {r['tp']} | {r['threads_per_rank']} | {r['decode_step_ms']:.1f} ms | "
            f"{r['decode_step_ms'] / base:.2f}x | {r.get('collectives_per_step', '-')} | "
            + (f"{r['collective_ms']:.2f} ms | {100 * r['collective_share']:.0f} % |"
               if "collective_ms" in r else "- | - |")
        )  # fmt: skip
    ar = doc["allreduce_us"]
    split = [r for r in doc["rows"] if "collectives_per_step" in r]
    if split:
        n = split[0]["collectives_per_step"]
        lines += [
            "",
            f"The collectives' time above includes each rank waiting for the other's "
            f"compute. The transport alone, one all-reduce of a step's hidden states "
            f"([{doc['batch']}, 1024] fp32) between two idle processes: {ar['shm']:.0f} us "
            f"through shared memory (what CPU ranks use, engine/parallel/shm_comm.py), "
            f"{ar['gloo']:.0f} us through gloo's sockets; {n} a step cost "
            f"{n * ar['shm'] / 1e3:.2f} ms and would cost {n * ar['gloo'] / 1e3:.1f} ms.",
        ]  # fmt: skip
    lines += [
        "",
        "Reproduce: `python -m benchmarks.tp_step --docs` (JSON in tp_step.json). Here two "
        "one-thread ranks were faster than one two-thread process; we have not profiled "
        "why, and do not claim it for other sizes or machines. What the split is for is "
        "room: a model whose weights do not fit one device's memory runs over several, "
        "every layer then waiting twice for the slowest rank.",
    ]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
