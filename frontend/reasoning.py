"""Reasoning models: their thinking split from their answer, as text.

A reasoning model writes its thinking between two tags, then its answer:

    <think>
    The user wants ... so the answer is 4.
    </think>

    2 + 2 = 4.

The thinking goes to ``message.reasoning_content`` (streamed as
``delta.reasoning_content``, vLLM's field) and to a reasoning item of the Responses
API; the answer, after the end tag (leading whitespace dropped), is the content, where
tool calls and structured output apply. A parser (:data:`PARSERS`, ``--reasoning-parser``)
names the tags and what an output that never writes the start tag means:

* ``deepseek_r1``: DeepSeek-R1 and its distillations, which may think without writing
  ``<think>`` (their templates open it): everything up to ``</think>`` is thinking,
  the whole output if the model never closes it;
* ``qwen3``: Qwen3 and QwQ, which open the block themselves when they think
  (``enable_thinking`` in ``chat_template_kwargs`` switches it): an output that does
  not begin with ``<think>`` is all answer.

Either way a prompt that ends inside an open block (the template wrote the start tag,
as DeepSeek-R1's and Qwen3-Thinking-2507's do, or the frontend did to enforce a
budget) starts the output in thinking (:meth:`ThinkFormat.opened_by`).

:class:`ReasoningStream` splits text pushed in chunks of any size and returns the same
parts whatever the chunking: a partial tag at the end of a chunk is held back until
the next shows what it is, and :func:`split` is the stream fed the whole text at once.
The token-exact count and the budget are the engine's (engine/reasoning.py); this is
the text side.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # thinking without the start tag: the output is thinking until the end tag
    implicit: bool = False

    def opened_by(self, prompt: str) -> bool:
        """Whether ``prompt`` (the rendered chat) ends inside an open thinking block."""
        at = prompt.rfind(self.start)
        return at >= 0 and prompt.find(self.end, at) < 0


PARSERS: dict[str, ThinkFormat] = {
    "deepseek_r1": ThinkFormat("deepseek_r1", implicit=True),
    "qwen3": ThinkFormat("qwen3"),
}


def default_parser(template: str | None) -> str | None:
    """The parser a chat template implies: ``qwen3`` for a template with Qwen3's
    ``enable_thinking`` switch, ``deepseek_r1`` for any other that writes ``<think>``,
    None (no reasoning parsed) for the rest."""
    if not template or "<think>" not in template:
        return None
    return "qwen3" if "enable_thinking" in template else "deepseek_r1"


@dataclass(frozen=True)
class Parts:
    """What a chunk (or a whole output) holds: thinking and answer text."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: Parts) -> Parts:
        return Parts(self.reasoning + other.reasoning, self.content + other.content)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """One choice's output split as it streams: ``push(text)`` returns the parts now
    final, ``finish()`` the rest."""

    def __init__(self, fmt: ThinkFormat, opened: bool = False) -> None:
        self.fmt = fmt
        # "start": nothing decided yet; "thinking"; "after": the end tag was seen and
        # the answer's leading whitespace is being dropped; "answer"
        self.state = "thinking" if opened else "start"
        self._held = ""
        self.thought = opened  # the output had a thinking block (or began in one)

    @property
    def thinking(self) -> bool:
        return self.state in ("start", "thinking")

    def push(self, text: str) -> Parts:
        buf = self._held + text
        self._held = ""
        out = Parts()
        while buf:
            if self.state == "start":
                lead, tag = buf.lstrip(), self.fmt.start
                if not lead or (len(lead) < len(tag) and tag.startswith(lead)):
                    self._held = buf  # whitespace, or maybe the start tag: wait
                    return out
                if lead.startswith(self.fmt.start):
                    self.state, self.thought = "thinking", True
                    buf = lead[len(self.fmt.start) :]
                elif self.fmt.implicit:
                    self.state, self.thought = "thinking", True
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                at = buf.find(self.fmt.end)
                if at >= 0:
                    out += Parts(reasoning=buf[:at])
                    self.state, buf = "after", buf[at + len(self.fmt.end) :]
                    continue
                keep = _partial_tag(buf, self.fmt.end)
                out += Parts(reasoning=buf[: len(buf) - keep])
                self._held = buf[len(buf) - keep :]
                return out
            elif self.state == "after":
                buf = buf.lstrip()
                if buf:
                    self.state = "answer"
            else:
                return out + Parts(content=buf)
        return out

    def finish(self) -> Parts:
        """The held text: a partial tag is text after all."""
        held, self._held = self._held, ""
        implicit = self.state == "start" and self.fmt.implicit and held.strip()
        if self.state == "thinking" or implicit:
            return Parts(reasoning=held)
        if self.state == "start":
            return Parts(content=held.strip() and held)
        return Parts(content=held) if self.state == "answer" else Parts()


def split(text: str, fmt: ThinkFormat, opened: bool = False) -> Parts:
    """A whole output's parts (what the stream gives fed ``text`` at once)."""
    stream = ReasoningStream(fmt, opened)
    return stream.push(text) + stream.finish()
