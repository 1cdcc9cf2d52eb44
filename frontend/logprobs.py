"""Log probabilities in the OpenAI formats, and each token's text and bytes.

Chat (``logprobs: true, top_logprobs: n``)::

    {"content": [{"token": "Hello", "logprob": -0.1, "bytes": [72, ...],
                  "top_logprobs": [{"token": ..., "logprob": ..., "bytes": [...]}, ...]}]}

Completions (``logprobs: n``), one entry per token in parallel lists; each
``top_logprobs`` dict holds the n most likely tokens and always the sampled one::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{...}], "text_offset": [...]}

A token's text is the token decoded on its own; a token holding part of a UTF-8
character decodes to U+FFFD, so its ``bytes`` come from the vocabulary entry instead
(byte-level BPE symbols, or SentencePiece ``<0xNN>`` byte tokens).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from engine.tokenizer import Tokenizer
from runtime.rpc import TokenLogprob

# JSON has no -inf; the OpenAI API never returns below this.
MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1
    bytes as themselves, the other 68 as U+0100 onwards, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


class TokenTexts:
    """Cached text and bytes of single tokens."""

    def __init__(self, tokenizer: Tokenizer, max_cached: int = 200_000) -> None:
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._max = max_cached

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._compute(token_id)
            if len(self._cache) < self._max:
                self._cache[token_id] = hit
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        try:
            piece = self._tok.convert_ids_to_tokens([token_id])[0]
        except ValueError:
            return text, list(text.encode("utf-8"))
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return text, [int(m.group(1), 16)]
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return text, [_BYTE_LEVEL[c] for c in piece]
        return text, list(text.encode("utf-8"))


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) and lp > MIN_LOGPROB else MIN_LOGPROB


def chat_logprobs(
    texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]
) -> list[dict[str, Any]]:
    """The ``content`` entries of a chat ``logprobs`` object for these tokens."""
    out = []
    for tid, lp in zip(token_ids, logprobs):
        text, raw = texts.get(tid)
        top = []
        for alt in lp.top:
            alt_text, alt_raw = texts.get(alt.token_id)
            top.append({"token": alt_text, "logprob": _finite(alt.logprob), "bytes": alt_raw})
        out.append(
            {"token": text, "logprob": _finite(lp.logprob), "bytes": raw, "top_logprobs": top}
        )
    return out


def completion_logprobs(
    texts: TokenTexts,
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprob],
    text_offset: int,
) -> dict[str, Any]:
    """A completions ``logprobs`` object; offsets count from ``text_offset``."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for tid, lp in zip(token_ids, logprobs):
        text = texts.text(tid)
        tokens.append(text)
        token_logprobs.append(_finite(lp.logprob))
        top = {texts.text(alt.token_id): _finite(alt.logprob) for alt in lp.top}
        top.setdefault(text, _finite(lp.logprob))
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
