"""One request of a workload, as the load generator will send it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Request:
    """A prompt with its token count and the number of tokens to ask for.

    `prompt` is the text sent to /v1/completions; `messages`, when set, is what a
    chat endpoint gets instead (otherwise one user message holding `prompt`).
    Requests that share a `session` are turns of one conversation: they are sent in
    order, each `think_time` seconds after the previous one finished; only a
    session's first turn follows the arrival process.
    """

    prompt: str
    prompt_len: int
    output_len: int
    messages: tuple[dict[str, Any], ...] | None = None
    session: int | None = None
    think_time: float = 0.0
    tag: str = ""
    thinking: int | None = None  # a reasoning model's thinking budget (max_reasoning_tokens)

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]


def chains(requests: list[Request]) -> list[list[int]]:
    """Indices grouped into chains: each session's turns in order, other requests alone.

    Chains are ordered by their first request's position, which is the order in
    which their arrivals are drawn.
    """
    out: list[list[int]] = []
    by_session: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        if r.session is None:
            out.append([i])
        elif r.session in by_session:
            by_session[r.session].append(i)
        else:
            chain = [i]
            by_session[r.session] = chain
            out.append(chain)
    return out
