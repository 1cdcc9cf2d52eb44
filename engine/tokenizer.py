"""The served model's tokenizer: text <-> token ids, chat templates, stop token ids.

`Tokenizer` wraps a transformers fast tokenizer and is the only tokenizer API the
rest of Diptych sees. Encoding and decoding go straight to the Rust backend
(`tokenizers.Tokenizer`), whose state is never changed after loading, so one
instance can serve many threads at once (transformers' own `__call__` toggles
truncation and padding on the shared backend, which is what makes it unsafe).

A GGUF file carries its tokenizer as metadata, and transformers takes seconds to
turn that into a fast tokenizer. The result is cached on disk, one directory per
GGUF file (keyed by its absolute path, size and mtime and the library versions):

    $DIPTYCH_CACHE_DIR/tokenizers/<stem>-<hash>/    (default ~/.cache/diptych)
        tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
        diptych-tokenizer.json                      written last: sha256 of every file

An entry is built in a temporary directory and renamed into place, so a reader
sees a complete entry or none; an entry that fails its checksums or fails to load
is discarded and the tokenizer converted again.

Incremental detokenization with stop strings: token ids in, final text deltas out.

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

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
import tokenizers
import transformers
from transformers import AutoTokenizer

from engine.weights.source import ModelSource, resolve_model

logger = logging.getLogger(__name__)

_CACHE_FORMAT = 1
_CACHE_MARKER = "diptych-tokenizer.json"

# Special tokens that close an assistant turn in the common chat formats (ChatML,
# Llama 3, Phi-3, Gemma) or end a document. A model that has one of them as a
# special token stops on it even when its config names only one eos id, as
# llama.cpp does.
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
)

CHAT_ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the messages."""


class Tokenizer:
    """Text <-> token ids for one model. Build it with `from_source` or `load_tokenizer`."""

    def __init__(self, hf_tokenizer: Any, name: str = "", extra_eos_ids: Sequence[int] = ()):
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            raise TypeError(
                f"{type(hf_tokenizer).__name__} is not a fast tokenizer; Diptych needs a "
                "tokenizer with a `tokenizers` backend (a tokenizer.json or a GGUF vocabulary)"
            )
        backend.no_truncation()
        backend.no_padding()
        self._hf = hf_tokenizer
        self._backend = backend
        self.name = name or str(getattr(hf_tokenizer, "name_or_path", ""))
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in added.items() if tok.special
        )
        self._eos_token_ids = self._collect_eos_ids(extra_eos_ids, added)

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_source(cls, source: ModelSource, *, cache_dir: Path | None = None) -> Tokenizer:
        """Load the tokenizer of a resolved model (GGUF through the on-disk cache)."""
        if source.kind == "gguf":
            hf = _load_gguf_tokenizer(source.path, cache_dir)
            return cls(hf, name=source.name)
        hf = AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
        return cls(hf, name=source.name, extra_eos_ids=_config_eos_ids(source.path))

    def _collect_eos_ids(self, extra: Sequence[int], added: Mapping[int, Any]) -> tuple[int, ...]:
        ids: list[int] = []
        if self._hf.eos_token_id is not None:
            ids.append(int(self._hf.eos_token_id))
        ids.extend(int(i) for i in extra)
        special_by_text = {tok.content: i for i, tok in added.items() if tok.special}
        ids.extend(special_by_text[t] for t in _END_OF_TURN_TOKENS if t in special_by_text)
        return tuple(dict.fromkeys(ids))

    # -- vocabulary --------------------------------------------------------------------

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer (for tests and tools, not the hot path)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return _optional_int(self._hf.bos_token_id)

    @property
    def eos_token_id(self) -> int | None:
        """The primary eos id; generation should stop on any of `eos_token_ids`."""
        return _optional_int(self._hf.eos_token_id)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos first, then the model's other stop tokens."""
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return _optional_int(self._hf.pad_token_id)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token's text can have: the longest vocabulary entry
        (a byte-level entry has one character per byte it stands for, a SentencePiece
        one its characters, a byte-fallback one like '<0xE2>' more than its byte), so a
        text of C characters needs at least C / max_token_chars tokens."""
        longest = max(
            (len(self._backend.id_to_token(i) or "") for i in range(self.vocab_size)), default=1
        )
        return max(longest, 1)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of `ids`, as stored (e.g. byte-level 'Ġhello')."""
        out = []
        for i in ids:
            token = self._backend.id_to_token(int(i))
            if token is None:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(token)
        return out

    def token_to_str(self, token_id: int) -> str:
        """The text of one token decoded on its own (special tokens kept)."""
        self.convert_ids_to_tokens([token_id])
        return self.decode([token_id], skip_special_tokens=False)

    # -- text <-> ids ------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the model wants (e.g. BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, not {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Spaces are never 'cleaned up' (that would mangle code)."""
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- chat --------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the model's chat template makes of `messages`.

        `content` may be a string or a list of OpenAI content parts; text parts are
        joined with newlines. Extra `kwargs` reach the template (e.g. `enable_thinking`,
        `continue_final_message`, or `chat_template` to override the model's).
        """
        conversation = _normalize_messages(messages)
        if kwargs.get("chat_template") is None and not self.has_chat_template:
            raise ChatTemplateError(
                f"model {self.name!r} has no chat template: send a plain prompt "
                "(completions API) or pass a chat template"
            )
        try:
            text = self._hf.apply_chat_template(
                conversation,
                tools=list(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"the chat template of {self.name!r} rejected the messages: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise ChatTemplateError("the chat template did not render to a single string")
        return text

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Prompt token ids for `messages` (the template writes any BOS itself)."""
        text = self.render_chat(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(model: str | None = None, *, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of `model` (a path, or None for the default model); an HF directory
    needs no weights for it."""
    return Tokenizer.from_source(resolve_model(model, weights=False), cache_dir=cache_dir)


# -- chat messages -----------------------------------------------------------------------


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} objects")
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {i} is a {type(message).__name__}, not an object")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"message {i} has role {role!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        normalized = dict(message)
        normalized["content"] = _content_text(message.get("content"), i)
        out.append(normalized)
    return out


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ValueError(
            f"message {index} content must be a string or a list of content parts, "
            f"not {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            raise ValueError(
                f"message {index} content part {j} has type {kind!r}: this model takes "
                "text only ({'type': 'text', 'text': ...})"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"message {index} content part {j} has no 'text' string")
        texts.append(text)
    return "\n".join(texts)


# -- stop ids from a HF directory ------------------------------------------------------------


def _config_eos_ids(directory: Path) -> list[int]:
    """eos ids named by generation_config.json and config.json (an int or a list each)."""
    ids: list[int] = []
    for filename in ("generation_config.json", "config.json"):
        try:
            value = json.loads((directory / filename).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))
    return ids


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


# -- the GGUF tokenizer cache ------------------------------------------------------------


def tokenizer_cache_root() -> Path:
    """Where converted tokenizers are kept: $DIPTYCH_CACHE_DIR/tokenizers or ~/.cache/diptych/..."""
    base = os.environ.get("DIPTYCH_CACHE_DIR")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "diptych"
    return root / "tokenizers"


def cache_key(gguf_path: Path) -> str:
    """Names one file's cache entry; changes when the file or the converting libraries do."""
    path = gguf_path.resolve()
    st = path.stat()
    ident = [
        str(path),
        st.st_size,
        st.st_mtime_ns,
        transformers.__version__,
        tokenizers.__version__,
        _CACHE_FORMAT,
    ]
    digest = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:20]
    return f"{path.stem[:60]}-{digest}"


def _convert_gguf(gguf_path: Path) -> Any:
    """The slow path: transformers builds a fast tokenizer from the GGUF metadata."""
    return AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )


def _load_gguf_tokenizer(gguf_path: Path, cache_dir: Path | None) -> Any:
    root = cache_dir if cache_dir is not None else tokenizer_cache_root()
    entry = root / cache_key(gguf_path)
    if entry.exists():
        try:
            return _read_entry(entry)
        except Exception as exc:  # any failure only means the entry cannot be used
            logger.warning("tokenizer cache %s is unusable (%s); converting again", entry, exc)
            _discard(entry)
    hf = _convert_gguf(gguf_path)
    try:
        _write_entry(hf, entry)
    except Exception as exc:  # a cache we cannot write costs time, nothing else
        logger.warning("could not cache the tokenizer of %s in %s: %s", gguf_path, entry, exc)
    return hf


def _read_entry(entry: Path) -> Any:
    marker = json.loads((entry / _CACHE_MARKER).read_text())
    if marker.get("format") != _CACHE_FORMAT:
        raise ValueError(f"cache format {marker.get('format')!r}, expected {_CACHE_FORMAT}")
    files: dict[str, str] = marker["files"]
    if "tokenizer.json" not in files:
        raise ValueError("entry holds no tokenizer.json")
    for name, digest in files.items():
        if _sha256(entry / name) != digest:
            raise ValueError(f"{name} does not match its checksum")
    return AutoTokenizer.from_pretrained(str(entry), local_files_only=True)


def _write_entry(hf: Any, entry: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        hf.save_pretrained(str(tmp))
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        marker = {"format": _CACHE_FORMAT, "files": files}
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker, indent=1))
        tmp.chmod(0o755)  # mkdtemp makes it private; other users may share the cache
        try:
            os.rename(tmp, entry)  # atomic; fails if another process got there first
        except OSError:
            if not entry.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard(entry: Path) -> None:
    """Move a bad entry aside, then delete it; readers holding its files are unharmed."""
    trash = entry.with_name(f".{entry.name}.bad-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, trash)
    except OSError:
        return  # already gone or replaced by another process
    shutil.rmtree(trash, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
        keep_special: frozenset[int] = frozenset(),
    ):
        # prompt_ids is accepted so callers can hand over a request as it is, but the
        # output text is decode(output_ids) alone: decoding it after the prompt would
        # give SentencePiece models a leading space the model never meant.
        # `keep_special`: special tokens kept even when skipping them (a tool-call or
        # thinking marker a parser reads, e.g. Mistral's [TOOL_CALLS]).
        del prompt_ids
        self._tokenizer = tokenizer
        self._special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._special -= keep_special
        # the ids left hold no other special token: decoding need skip none
        self._skip_special = skip_special_tokens and not keep_special
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
