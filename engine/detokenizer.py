"""Incremental detokenization with stop strings: token ids in, final text deltas out.

Two stages, each holding back only what it must:

1. Decoding. Decoding one token at a time is wrong twice over: a character may be
   split across tokens (byte-level BPE, byte-fallback `<0xF0>` tokens), and some
   decoders treat the first token of a sequence specially (SentencePiece drops its
   leading space). So each step decodes a short window of ids and keeps the part
   past what the window's earlier tokens already produced:

       ids:  0 ...... prefix_offset ........ read_offset ........ len(ids)
                      |-- emitted already ---|- not emitted yet --|
       delta = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

   While the window's text ends in U+FFFD (an incomplete character) nothing is
   emitted; once it does not, the offsets move up and the window shrinks back to
   the last emitted tokens. The cost per token is that of decoding the window, a
   few tokens, whatever the output length (a pushed chunk is stepped through token
   by token for that reason). The deltas add up to
   `tokenizer.decode(output_ids, skip_special_tokens)`; the prompt plays no part.
   With `skip_special_tokens`, special ids are dropped on arrival, exactly as
   `decode` drops them, so they never open a window.

2. Stop strings. Decoded text is searched for the stop strings; the earliest stop
   string to be completed wins (ties: the longest). The match and everything after
   it are dropped (or the match kept, with `include_stop_str_in_output`). Text that
   could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"

# A valid UTF-8 character spans at most 4 bytes, so at most 4 tokens. A window
# that still ends in U+FFFD after this many held tokens holds bytes that are not
# UTF-8 at all; it is emitted as is so that the window stays short.
_MAX_HELD_TOKENS = 16
_TRIM_AT = 1024


class _Decoder(Protocol):
    special_token_ids: frozenset[int]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, honouring stop strings.

    `push(ids)` returns the text that became final; `flush()` the rest at the end.
    After a stop string matched, `stopped` is true, `stop_reason` names it, and
    further pushes return "".
    """

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        # prompt_ids is accepted so callers can hand over a request as it is, but the
        # output text is decode(output_ids) alone: decoding it after the prompt would
        # give SentencePiece models a leading space the model never meant.
        del prompt_ids
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])

        stops = list(dict.fromkeys(stop or ()))
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = stops
        self._include_stop = include_stop_str_in_output
        self._tail_len = max((len(s) for s in stops), default=1) - 1
        self._tail = ""  # the last _tail_len characters of decoded text
        self._held = ""  # the unemitted end of _tail (could begin a stop string)

        self._parts: list[str] = []
        self.stopped = False
        self.stop_reason: str | None = None
        self._flushed = False

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta returned)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text that is now final (maybe "")."""
        if self._flushed:
            raise RuntimeError("push() after flush(): this detokenizer has finished")
        if self.stopped:
            return ""
        # One token at a time, so that a chunk ending inside a character costs no
        # more than a single token doing so.
        text = []
        for token_id in token_ids:
            if token_id in self._special:
                continue
            self._ids.append(int(token_id))
            text.append(self._decode_step(final=False))
        return self._on_text("".join(text), final=False) if text else ""

    def flush(self) -> str:
        """End of output: return everything still held (incomplete characters as U+FFFD)."""
        if self._flushed or self.stopped:
            self._flushed = True
            return ""
        self._flushed = True
        return self._on_text(self._decode_step(final=True), final=True)

    # -- stage 1: ids -> final text ----------------------------------------------------

    def _decode_step(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        window = self._tokenizer.decode(
            self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special
        )
        held_tokens = len(self._ids) - self._read_offset
        if not final and window.endswith(_REPLACEMENT) and held_tokens < _MAX_HELD_TOKENS:
            return ""
        # window starts with _prefix_text unless the output is not UTF-8 (a byte-fallback
        # run that turned invalid after part of it was emitted); then the text may
        # differ from decode() in where the U+FFFD go.
        delta = window[len(self._prefix_text) :]
        if self._read_offset > _TRIM_AT:
            # Forget ids before the window so memory stays bounded too.
            del self._ids[: self._read_offset]
            self._prefix_offset = 0
        else:
            self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._tokenizer.decode(
            self._ids[self._prefix_offset :], skip_special_tokens=self._skip_special
        )
        return delta

    # -- stage 2: stop strings -----------------------------------------------------------

    def _on_text(self, chunk: str, final: bool) -> str:
        if not self._stops:
            return self._emit(chunk)
        buf = self._tail + chunk
        emitted_end = len(self._tail) - len(self._held)  # buf[:emitted_end] already out
        match = self._find_stop(buf, len(self._tail))
        if match is not None:
            start, end, stop = match
            self.stopped = True
            self.stop_reason = stop
            cut = end if self._include_stop else start
            self._held = ""
            return self._emit(buf[emitted_end:cut])
        hold = 0 if (final or self._include_stop) else self._stop_prefix_len(buf)
        keep_from = len(buf) - hold
        assert keep_from >= emitted_end, "held text must be a suffix of unemitted text"
        self._held = buf[keep_from:]
        self._tail = buf[max(len(buf) - self._tail_len, 0) :]
        return self._emit(buf[emitted_end:keep_from])

    def _find_stop(self, buf: str, old_len: int) -> tuple[int, int, str] | None:
        """The stop string completed first in `buf` (ending past `old_len`)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop, max(old_len - len(stop) + 1, 0))
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[1], best[0]):
                best = (start, end, stop)
        return best

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest end of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, delta: str) -> str:
        if delta:
            self._parts.append(delta)
        return delta
