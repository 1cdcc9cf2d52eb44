"""`diptych generate` and `diptych chat`: the engine in-process, streaming to a terminal."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO, TypedDict

from engine import LLM, NewRequest, SamplingParams
from engine.tokenizer import IncrementalDetokenizer


class CompletionStats(TypedDict):
    """One prompt's completion: its figures and its text."""

    prompt_tokens: int
    output_tokens: int
    finish_reason: str | None
    ttft_s: float
    decode_tok_s: float
    text: str


def stream_completion(
    llm: LLM,
    prompt_ids: list[int],
    params: SamplingParams,
    write: Callable[[str], None],
) -> CompletionStats:
    """Generate for one prompt, writing text as it is produced; return stats."""
    core = llm.engine
    rid = f"cli-{time.monotonic_ns()}"
    det = IncrementalDetokenizer(llm.tokenizer, prompt_ids, stop=params.stop)
    start = time.perf_counter()
    first = None
    n_out = 0
    finish = None
    core.submit(NewRequest(rid, prompt_ids, params))
    try:
        while finish is None:
            for out in core.step():
                if out.request_id != rid:
                    continue
                if first is None:
                    first = time.perf_counter()
                n_out += len(out.new_token_ids)
                write(det.push(out.new_token_ids))
                if det.stopped:
                    core.abort_request(rid)
                    finish = "stop"
                elif out.finished:
                    write(det.flush())
                    finish = out.finish_reason
    except BaseException:
        if rid in core.scheduler.requests:
            core.abort_request(rid)
        raise
    end = time.perf_counter()
    ttft = (first or end) - start
    decode_s = end - (first or end)
    return {
        "prompt_tokens": len(prompt_ids),
        "output_tokens": n_out,
        "finish_reason": finish,
        "ttft_s": ttft,
        "decode_tok_s": (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else 0.0,
        "text": det.text,
    }


def _stats_line(s: CompletionStats) -> str:
    return (
        f"[{s['prompt_tokens']} prompt + {s['output_tokens']} output tokens, "
        f"TTFT {s['ttft_s'] * 1000:.0f} ms, {s['decode_tok_s']:.1f} tok/s, "
        f"finish: {s['finish_reason']}]"
    )


def _writer(out: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        if text:
            out.write(text)
            out.flush()

    return write


def run_generate(
    llm: LLM, prompt: str, params: SamplingParams, *, chat: bool, quiet: bool = False
) -> CompletionStats:
    if chat and llm.tokenizer.has_chat_template:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        ids = llm.tokenizer.encode(prompt)
    stats = stream_completion(llm, ids, params, _writer(sys.stdout))
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        print(_stats_line(stats), file=sys.stderr)
    return stats


def run_chat(
    llm: LLM,
    params: SamplingParams,
    *,
    system: str | None = None,
    read: Callable[[str], str] = input,
) -> None:
    """A terminal chat: keeps the conversation; /reset clears it, /exit or EOF quits."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print("Chatting with the model. /reset starts over, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return
        if cmd == "/reset":
            history = history[:1] if system else []
            continue
        if not cmd:
            continue
        history.append({"role": "user", "content": line})
        ids = llm.tokenizer.apply_chat_template(history)
        stats = stream_completion(llm, ids, params, _writer(sys.stdout))
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(_stats_line(stats), file=sys.stderr)
        history.append({"role": "assistant", "content": stats["text"]})
