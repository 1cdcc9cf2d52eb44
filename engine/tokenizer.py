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
from typing import Any

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
