"""IncrementalDetokenizer: deltas add up to decode(), characters are never split, stops hold."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from engine.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, résumé — “curly quotes” and ‘single’ ones… Größe, Ærø, Œuvre",
    "中文字符和标点。日本語のテキスト、カタカナ。한국어 문장입니다.",
    "emoji 😀🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "  leading spaces, trailing spaces   ",
    "tabs\t\tand\nnewlines\n\n\nand\r\nCRLF and\u00a0nbsp and\u2003em space",
    "def f(x: int) -> int:\n    return x ** 2  # squares\n\nprint(f(3))\n",
    'fn main() { let v: Vec<u8> = vec![0xF0, 0x9F]; println!("{:?}", v); }',
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी, ไทย",
    "combining: e\u0301 a\u0308 n\u0303; math: ∑∫√∞ ≤ ≥ ≠; box: ┌─┐",
    "x",
    " ",
    "",
]


# -- tokenizers under test -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """SmolLM2's byte-level BPE, converted once per session into a shared cache."""
    cache = tmp_path_factory.getbasetemp() / "diptych-tokenizer-cache"
    return load_tokenizer(cache_dir=cache)


_CORPUS = [
    "hello world this is a test of the tokenizer with some words",
    "the quick brown fox jumps over the lazy dog again and again",
    "def foo(x):\n    return x + 1\n",
    "café naïve résumé",
] * 20


def _byte_fallback_tokenizer(metaspace_pre_tokenizer: bool) -> Tokenizer:
    """A small SentencePiece-style BPE: unknown characters fall back to <0xXX> tokens.

    Two layouts, as real checkpoints have them: Llama 2 (normalizer prepends "▁",
    decoder strips one leading space) and the newer Metaspace pre-tokenizer/decoder.
    """
    trained = RustTokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=320, show_progress=False))
    model_vocab = trained.get_vocab()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in sorted(model_vocab, key=model_vocab.__getitem__):
        vocab.setdefault(piece, len(vocab))
    raw_merges = json.loads(trained.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in raw_merges]
    tok = RustTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    if metaspace_pre_tokenizer:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    else:
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return Tokenizer(hf, name="byte-fallback")


@pytest.fixture(scope="module", params=["llama2-style", "metaspace"])
def byte_fallback(request: pytest.FixtureRequest) -> Tokenizer:
    return _byte_fallback_tokenizer(metaspace_pre_tokenizer=request.param == "metaspace")


@pytest.fixture(scope="module", params=["smol", "llama2-style", "metaspace"])
def any_tok(request: pytest.FixtureRequest, smol: Tokenizer) -> Tokenizer:
    if request.param == "smol":
        return smol
    return _byte_fallback_tokenizer(metaspace_pre_tokenizer=request.param == "metaspace")


class CharTokenizer:
    """One character per token: lets stop-string tests place token boundaries exactly."""

    special_token_ids: frozenset[int] = frozenset({0})

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {"<eos>": 0}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(c, len(self.vocab)) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        by_id = {i: c for c, i in self.vocab.items()}
        skip = self.special_token_ids if skip_special_tokens else frozenset()
        return "".join(by_id[i] for i in ids if i not in skip)


def _run(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int) -> list[str]:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


# -- deltas add up to decode() -------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_decode(any_tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(0)
    specials = sorted(any_tok.special_token_ids)
    for text in TEXTS:
        ids = any_tok.encode(text, add_special_tokens=False)
        # Sprinkle special tokens in (they vanish with skip and show without), between
        # characters: one inside a byte-fallback run would make the output invalid UTF-8.
        boundaries = [
            k for k in range(len(ids) + 1) if not any_tok.decode(ids[:k]).endswith("\ufffd")
        ]
        with_special = list(ids)
        for k in sorted(rng.sample(boundaries, min(2, len(boundaries))), reverse=True):
            with_special.insert(k, rng.choice(specials))
        for output in (ids, with_special):
            expected = any_tok.decode(output, skip_special_tokens=skip)
            for chunk in (1, 2, 3, 7, max(len(output), 1)):
                detok = IncrementalDetokenizer(any_tok, [], skip_special_tokens=skip)
                deltas = _run(detok, output, chunk)
                assert "".join(deltas) == expected, (text, chunk)
                assert detok.text == expected
                if "\ufffd" not in expected:
                    assert not any("\ufffd" in d for d in deltas), (text, chunk, deltas)


def test_text_round_trips_through_deltas(any_tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = any_tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(any_tok, any_tok.encode("a prompt"))
        assert "".join(_run(detok, ids, 1)) == any_tok.decode(ids)


def test_random_token_ids_match_decode(smol: Tokenizer) -> None:
    # Random ids make invalid UTF-8 (stray continuation bytes, truncated characters);
    # byte-level BPE decodes it lossily, and the deltas must agree byte for byte.
    rng = random.Random(1234)
    for _ in range(150):
        ids = [rng.randrange(smol.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            chunk = rng.choice([1, 2, 5])
            detok = IncrementalDetokenizer(smol, [], skip_special_tokens=skip)
            assert "".join(_run(detok, ids, chunk)) == smol.decode(ids, skip), ids


def test_byte_level_emoji_is_split_and_held(smol: Tokenizer) -> None:
    ids = smol.encode("😀", add_special_tokens=False)
    assert len(ids) > 1, "SmolLM2 splits this emoji's 4 bytes across tokens"
    assert smol.decode(ids[:1]).endswith("\ufffd")
    detok = IncrementalDetokenizer(smol, [])
    assert [detok.push([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_byte_fallback_character_is_held_until_complete(byte_fallback: Tokenizer) -> None:
    tok = byte_fallback
    ids = tok.encode("ab 😀 c", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert [p for p in pieces if p.startswith("<0x")] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == "ab 😀 c"
    assert not any("\ufffd" in d for d in deltas)
    assert "😀" in deltas


def test_flush_emits_an_incomplete_character(byte_fallback: Tokenizer) -> None:
    tok = byte_fallback
    ids = tok.encode("hi 😀", add_special_tokens=False)[:-2]  # cut the emoji short
    detok = IncrementalDetokenizer(tok, [])
    pushed = "".join(detok.push([i]) for i in ids)
    assert "\ufffd" not in pushed
    assert pushed + detok.flush() == tok.decode(ids)
    assert tok.decode(ids).endswith("\ufffd")


def test_work_per_token_stays_bounded(smol: Tokenizer) -> None:
    lengths: list[int] = []

    class Counting:
        special_token_ids = smol.special_token_ids

        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return smol.decode(ids, skip_special_tokens)

    ids = smol.encode("Streaming text, with emoji 😀 and 中文, goes on. " * 150)
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(Counting(), [])
    assert "".join(_run(detok, ids, 1)) == smol.decode(ids)
    assert max(lengths) <= 8
    assert len(lengths) <= 2 * len(ids) + 2


# -- stop strings ----------------------------------------------------------------------------


def _expected_stop(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Reference: the stop string completed first (then the longest) wins."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found, key=lambda m: (m[0], m[1]))
    return text[: end if include else start], stop


def test_stop_split_across_tokens(smol: Tokenizer) -> None:
    text = "The answer is 42. Observation: done"
    ids = smol.encode(text, add_special_tokens=False)
    pieces = [smol.decode([i]) for i in ids]
    assert not any("Observation:" in p for p in pieces), "the stop string spans tokens"
    for chunk in (1, 2, 4, len(ids)):
        detok = IncrementalDetokenizer(smol, [], stop=["Observation:"])
        deltas = _run(detok, ids, chunk)
        assert "".join(deltas) == "The answer is 42. "
        assert detok.stopped and detok.stop_reason == "Observation:"
        assert detok.text == "The answer is 42. "


def test_stop_partial_match_is_held_then_released() -> None:
    tok = CharTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    assert detok.push(tok.encode("go S")) == "go "
    assert detok.push(tok.encode("T")) == ""
    assert detok.push(tok.encode("Ox")) == "STOx"
    assert detok.push(tok.encode("ST")) == ""
    assert detok.flush() == "ST"  # the end: it can no longer become a stop
    assert detok.text == "go STOxST" and not detok.stopped


def test_stop_at_the_very_start_and_after() -> None:
    tok = CharTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["</s>"])
    assert detok.push(tok.encode("</s>more")) == ""
    assert detok.stopped and detok.stop_reason == "</s>"
    assert detok.push(tok.encode("ignored")) == ""
    assert detok.flush() == "" and detok.text == ""


def test_include_stop_str_in_output() -> None:
    tok = CharTokenizer()
    detok = IncrementalDetokenizer(tok, [], stop=["END"], include_stop_str_in_output=True)
    # nothing is held back: whatever comes, the text reaching the stop is output
    assert detok.push(tok.encode("abcE")) == "abcE"
    assert detok.push(tok.encode("N")) == "N"
    assert detok.push(tok.encode("D and more")) == "D"
    assert detok.text == "abcEND" and detok.stop_reason == "END"


def test_multiple_stop_strings_first_completed_wins() -> None:
    tok = CharTokenizer()
    cases = [
        ("Hello world", ["world", "lo w"], "Hel", "lo w"),
        ("xab", ["b", "ab"], "x", "ab"),  # same end: the longer one
        ("abcd", ["abcd", "bc"], "a", "bc"),  # "bc" completes before "abcd" could
        ("no stop here", ["zzz", "yy"], "no stop here", None),
    ]
    for text, stops, want, reason in cases:
        for chunk in (1, 3, len(text)):
            detok = IncrementalDetokenizer(tok, [], stop=stops)
            assert "".join(_run(detok, tok.encode(text), chunk)) == want, (text, chunk)
            assert detok.stop_reason == reason


def test_stop_strings_property() -> None:
    tok = CharTokenizer()
    rng = random.Random(7)
    alphabet = "ab c\n"
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
            for _ in range(rng.randrange(1, 4))
        ]
        include = rng.random() < 0.5
        want, reason = _expected_stop(text, stops, include)
        detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        chunk = rng.choice([1, 2, 5])
        deltas = _run(detok, tok.encode(text), chunk)
        assert "".join(deltas) == want, (text, stops, include, chunk)
        assert detok.stop_reason == reason


def test_stop_string_with_multibyte_character(smol: Tokenizer) -> None:
    ids = smol.encode("before 🎉 after", add_special_tokens=False)
    for include, want in ((False, "before "), (True, "before 🎉")):
        detok = IncrementalDetokenizer(smol, [], stop=["🎉"], include_stop_str_in_output=include)
        deltas = _run(detok, ids, 1)
        assert "".join(deltas) == want
        assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_do_not_break_a_stop_string(smol: Tokenizer) -> None:
    im_end = smol.eos_token_ids[0]
    ids = smol.encode("one STO", add_special_tokens=False)
    ids += [im_end, *smol.encode("P two", add_special_tokens=False)]
    detok = IncrementalDetokenizer(smol, [], stop=["STOP"])  # skip_special_tokens: "one STOP two"
    assert "".join(_run(detok, ids, 1)) == "one "


def test_misuse_is_reported() -> None:
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=[""])
    detok = IncrementalDetokenizer(tok, [])
    assert detok.push(tok.encode("hi")) == "hi"
    assert detok.flush() == ""
    with pytest.raises(RuntimeError, match="flush"):
        detok.push(tok.encode("more"))
