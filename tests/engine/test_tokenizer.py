"""Tokenizer: the default model's tokenizer, its chat template, and the GGUF tokenizer cache."""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import engine.tokenizer as tokenizer_module
from engine.tokenizer import (
    ChatTemplateError,
    Tokenizer,
    cache_key,
    load_tokenizer,
    tokenizer_cache_root,
)
from engine.weights.source import ModelSource, resolve_model

TEXTS = [
    "Hello, world!",
    "  leading and trailing  ",
    "naïve café 中文 日本語 😀👨‍👩‍👧 🇫🇷",
    "def f(x):\n\treturn x ** 2  # code\n",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 😀"},
    ],
    [
        {"role": "user", "content": "Call the tool"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": '{"temperature": 21}'},
    ],
]


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "diptych-tokenizer-cache"


@pytest.fixture(scope="module")
def tok(shared_cache: Path) -> Tokenizer:
    return load_tokenizer(cache_dir=shared_cache)


def _entry(cache: Path) -> Path:
    return cache / cache_key(resolve_model(None).path)


# -- the default model ---------------------------------------------------------------------


def test_round_trip_and_agreement_with_transformers(tok: Tokenizer) -> None:
    hf = tok.hf_tokenizer
    for text in TEXTS:
        for add_special in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special)
        assert tok.decode(ids, skip_special_tokens=False) == text
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )


def test_smollm2_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    # The GGUF names <|im_start|> as BOS but asks for none to be added (add_bos_token=False).
    assert tok.bos_token_id == 1
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)
    # eos is <|im_end|>; <|endoftext|> (the base model's end of document) also stops.
    assert tok.eos_token_id == 2
    assert tok.eos_token_ids == (2, 0)
    assert tok.pad_token_id == 2
    assert set(range(17)) == tok.special_token_ids
    assert tok.decode([1, 4093, 2]) == "user"
    assert tok.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"
    assert tok.token_to_str(10813) == "\ufffd"  # first two bytes of a 4-byte emoji
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([tok.vocab_size])
    with pytest.raises(TypeError):
        tok.encode(["not", "a", "string"])  # type: ignore[arg-type]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    hf = tok.hf_tokenizer
    text = tok.render_chat(conversation, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert ids == hf.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids[0] == 1  # the template opens with <|im_start|>, written as text
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first line"}, {"type": "text", "text": "second line"}]
    as_parts = tok.apply_chat_template([{"role": "user", "content": parts}])
    as_text = tok.apply_chat_template([{"role": "user", "content": "first line\nsecond line"}])
    assert as_parts == as_text
    # assistant turns that only call tools may have content None
    assert "<|im_start|>assistant\n<|im_end|>" in tok.render_chat(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "empty"),
        ("hello", "list"),
        ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
        ([{"content": "x"}], "role None"),
        (["just a string"], "not an object"),
        ([{"role": "user", "content": 42}], "string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "type 'image_url'",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "no 'text' string"),
    ],
)
def test_bad_messages_are_rejected(tok: Tokenizer, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_missing_or_failing_chat_template(tok: Tokenizer) -> None:
    hf = copy.deepcopy(tok.hf_tokenizer)
    hf.chat_template = None
    bare = Tokenizer(hf, name="bare")
    assert tok.has_chat_template and not bare.has_chat_template
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template(messages)
    # a template passed in works even then
    assert bare.render_chat(messages, chat_template="{{ messages[0].content }}!") == "hi!"
    with pytest.raises(ChatTemplateError, match="rejected the messages: roles must alternate"):
        tok.render_chat(messages, chat_template="{{ raise_exception('roles must alternate') }}")


def test_concurrent_use_from_threads(tok: Tokenizer) -> None:
    texts = [f"request {i}: " + TEXTS[i % len(TEXTS)] * 20 for i in range(64)]
    expected = [tok.encode(t) for t in texts]

    def work(i: int) -> tuple[list[int], str]:
        ids = tok.encode(texts[i])
        return ids, tok.decode(ids, skip_special_tokens=False)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(work, range(len(texts))))
    assert [ids for ids, _ in results] == expected
    assert [text for _, text in results] == texts


def test_hf_directory_source(tok: Tokenizer, tmp_path: Path) -> None:
    tok.hf_tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    loaded = Tokenizer.from_source(ModelSource("hf", tmp_path, "copy"))
    assert loaded.name == "copy"
    assert loaded.eos_token_ids == (2, 5, 7, 0)
    assert loaded.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_a_directory_without_weights_is_enough_for_the_tokenizer(
    tok: Tokenizer, tmp_path: Path
) -> None:
    """The frontend loads only the tokenizer: the chart copies it an HF directory's
    config and tokenizer files, no safetensors. The engine still needs the weights."""
    model = tmp_path / "Some-Model-Instruct"
    tok.hf_tokenizer.save_pretrained(str(model))
    (model / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    loaded = load_tokenizer(str(model))
    assert loaded.name == "Some-Model-Instruct" and 7 in loaded.eos_token_ids
    assert loaded.encode(TEXTS[2]) == tok.encode(TEXTS[2])
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(model)


# -- the GGUF tokenizer cache --------------------------------------------------------------


def test_second_load_comes_from_the_cache(
    tok: Tokenizer, shared_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = _entry(shared_cache)
    assert (entry / "diptych-tokenizer.json").is_file()
    assert not [p for p in shared_cache.iterdir() if p.name.startswith(".")], "no temp dirs left"

    def no_conversion(path: Path) -> Any:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(tokenizer_module, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    again = load_tokenizer(cache_dir=shared_cache)
    assert time.perf_counter() - start < 2.0  # conversion takes ~3 s on two cores
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
    messages = CONVERSATIONS[1]
    assert again.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert again.eos_token_ids == tok.eos_token_ids
    assert again.bos_token_id == tok.bos_token_id


def _converting_spy(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the slow conversion with a copy of the converted tokenizer; record calls."""
    calls: list[Path] = []
    lock = threading.Lock()

    def convert(path: Path) -> Any:
        with lock:
            calls.append(path)
            return copy.deepcopy(tok.hf_tokenizer)

    monkeypatch.setattr(tokenizer_module, "_convert_gguf", convert)
    return calls


@pytest.mark.parametrize("damage", ["garbage tokenizer.json", "no marker", "bad marker", "empty"])
def test_unusable_cache_falls_back_and_is_rebuilt(
    tok: Tokenizer, shared_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    entry = tmp_path / _entry(shared_cache).name
    shutil.copytree(_entry(shared_cache), entry)
    if damage == "garbage tokenizer.json":
        (entry / "tokenizer.json").write_text('{"truncated": ')
    elif damage == "no marker":
        (entry / "diptych-tokenizer.json").unlink()
    elif damage == "bad marker":
        (entry / "diptych-tokenizer.json").write_text("not json")
    else:
        shutil.rmtree(entry)
        entry.mkdir()
    calls = _converting_spy(tok, monkeypatch)
    fallback = load_tokenizer(cache_dir=tmp_path)
    assert len(calls) == 1
    assert fallback.encode(TEXTS[2]) == tok.encode(TEXTS[2])
    # the entry was rebuilt: the next load converts nothing
    assert load_tokenizer(cache_dir=tmp_path).encode(TEXTS[3]) == tok.encode(TEXTS[3])
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry.name]


def test_real_fallback_from_a_corrupt_cache(
    tok: Tokenizer, shared_cache: Path, tmp_path: Path
) -> None:
    """The slow path for real: a corrupt entry, then transformers converts the GGUF again."""
    entry = tmp_path / _entry(shared_cache).name
    shutil.copytree(_entry(shared_cache), entry)
    (entry / "tokenizer.json").write_bytes(b"\0" * 100)
    fallback = load_tokenizer(cache_dir=tmp_path)
    for text in TEXTS:
        assert fallback.encode(text) == tok.encode(text)
    assert fallback.render_chat(CONVERSATIONS[0]) == tok.render_chat(CONVERSATIONS[0])


def test_unwritable_cache_still_loads(
    tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    calls = _converting_spy(tok, monkeypatch)
    loaded = load_tokenizer(cache_dir=not_a_dir / "tokenizers")
    assert loaded.encode("hello") == tok.encode("hello") and len(calls) == 1


def test_loaders_racing_leave_one_complete_entry(
    tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _converting_spy(tok, monkeypatch)
    barrier = threading.Barrier(4)

    def load(_: int) -> list[int]:
        barrier.wait()
        return load_tokenizer(cache_dir=tmp_path).encode(TEXTS[2])

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(load, range(4)))
    assert all(r == tok.encode(TEXTS[2]) for r in results)
    assert len(calls) >= 1
    names = [p.name for p in tmp_path.iterdir()]
    assert names == [_entry(tmp_path).name], "one entry, no temp dirs"
    calls.clear()
    load_tokenizer(cache_dir=tmp_path)
    assert calls == []


def test_cache_location_and_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIPTYCH_CACHE_DIR", str(tmp_path / "c"))
    assert tokenizer_cache_root() == tmp_path / "c" / "tokenizers"
    monkeypatch.delenv("DIPTYCH_CACHE_DIR")
    assert tokenizer_cache_root() == Path.home() / ".cache" / "diptych" / "tokenizers"

    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    key = cache_key(f)
    assert key.startswith("model-") and cache_key(f) == key
    os.utime(f, ns=(1, 1))
    assert cache_key(f) != key  # the file changed
    linked = tmp_path / "link.gguf"
    linked.symlink_to(f)
    assert cache_key(linked) == cache_key(f)  # same file, same entry


def test_env_cache_dir_is_used(
    tok: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIPTYCH_CACHE_DIR", str(tmp_path))
    _converting_spy(tok, monkeypatch)
    load_tokenizer()
    assert (tmp_path / "tokenizers" / _entry(tmp_path).name / "tokenizer.json").is_file()
