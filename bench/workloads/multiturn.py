"""A multi-turn chat / agent trace whose prompts share prefixes.

Sessions are conversations over one of `num_systems` system prompts (think of them
as agents, each with its own long instructions; `system_share` puts that share of the
sessions on the first one, the skew of one popular agent), so two kinds of prefix
repeat:

    session A, turn 1:  [system 0][user A1]
    session A, turn 2:  [system 0][user A1][reply A1][user A2]   <- all of turn 1 again
    session B, turn 1:  [system 0][user B1]                      <- system 0 again

Each turn is sent after the previous turn of its session has finished (plus
`think_time`); only first turns follow the arrival process. The assistant replies
are written by the client (`turn_output_len` tokens of text), not taken from the
server, so the trace is the same on every server and every run; the server's own
output tokens are therefore not part of the next prompt's cacheable prefix.

The prompt text is the conversation rendered with the model's chat template, sent
to /v1/completions, so its token count is exact; chat endpoints get the messages.
"""

from __future__ import annotations

import math
import random

from bench.request import Request
from bench.workloads.spec import WorkloadSpec
from bench.workloads.tokens import PromptBuilder


def multiturn(spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    rng = random.Random(spec.seed)
    systems = [builder.text(spec.system_len, rng) for _ in range(spec.num_systems)]
    sessions = -(-spec.num_prompts // spec.turns)
    out: list[Request] = []
    for s in range(sessions):
        system = _system(systems, spec.system_share, rng)
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        for turn in range(spec.turns):
            if len(out) == spec.num_prompts:
                break
            messages.append({"role": "user", "content": builder.text(spec.user_len, rng)})
            think = spec.think_time if turn else 0.0
            out.append(_turn(builder, messages, spec.turn_output_len, s, turn, think))
            reply = builder.text(spec.turn_output_len, rng)
            messages.append({"role": "assistant", "content": reply})
    return out


def agentic(spec: WorkloadSpec, builder: PromptBuilder) -> list[Request]:
    """Agent sessions: a system prompt (one of `num_systems`) and a task, then turns of
    the model's output (a tool call, written by the client) and the tool's result (its
    length lognormal around `tool_len`) that arrives `tool_latency` seconds later on
    average (exponential). A session's context grows every turn by both; its prefix is
    all of the previous turn's prompt."""
    rng = random.Random(spec.seed)
    systems = [builder.text(spec.system_len, rng) for _ in range(spec.num_systems)]
    sessions = -(-spec.num_prompts // spec.turns)
    mu = math.log(spec.tool_len) - spec.tool_len_sigma**2 / 2  # a mean of tool_len
    out: list[Request] = []
    for s in range(sessions):
        messages: list[dict[str, str]] = [
            {"role": "system", "content": _system(systems, spec.system_share, rng)},
            {"role": "user", "content": builder.text(spec.user_len, rng)},
        ]
        for turn in range(spec.turns):
            if len(out) == spec.num_prompts:
                break
            if turn:
                messages.append({"role": "assistant",
                                 "content": builder.text(spec.turn_output_len, rng)})
                tool = max(1, round(rng.lognormvariate(mu, spec.tool_len_sigma)))
                # (the builder's text only: the simulator's builder maps it to ids)
                messages.append({"role": "user", "content": builder.text(tool, rng)})
            wait = rng.expovariate(1 / spec.tool_latency) if turn and spec.tool_latency else 0.0
            out.append(_turn(builder, messages, spec.turn_output_len, s, turn, wait))
    return out


def _turn(builder: PromptBuilder, messages: list[dict[str, str]], output_len: int,
          session: int, turn: int, think_time: float) -> Request:  # fmt: skip
    """One turn's request: the conversation so far rendered with the chat template."""
    prompt = builder.render_chat(messages)
    return Request(
        prompt=prompt,
        prompt_len=builder.count(prompt),
        output_len=output_len,
        messages=tuple(dict(m) for m in messages),
        session=session,
        think_time=think_time,
        tag=f"turn{turn + 1}",
    )


def _system(systems: list[str], share: float | None, rng: random.Random) -> str:
    """A session's system prompt: uniform, or the first one for ``share`` of sessions."""
    if share is None:
        return systems[rng.randrange(len(systems))]
    if len(systems) == 1 or rng.random() < share:
        return systems[0]
    return systems[1 + rng.randrange(len(systems) - 1)]
