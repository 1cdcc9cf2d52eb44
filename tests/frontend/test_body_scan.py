"""frontend/body_scan.py against json.loads: on any body, well-formed or not, the scan
either gives up or brackets the text at its paths between its two bounds."""

from __future__ import annotations

import json
import random
from typing import Any

from frontend.body_scan import text_bounds
from frontend.protocol import _TEXT_PATHS, message_chars

PATHS = (*_TEXT_PATHS["prompt"], *_TEXT_PATHS["messages"])
ALPHABET = ["a", " ", '"', "\\", "\n", "\t", "é", "字", "😀", "\x01", "/", "}", "]", ",", ":"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 30)))


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return _text(rng)
    if kind == 1:
        return rng.choice([0, -1.5e3, 12, True, False, None])
    if kind == 2:
        return _text(rng)
    if kind == 3:
        return rng.randrange(1000)
    if kind == 4:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["prompt", "messages", "content", "text", "role", "model", _text(rng)]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _body(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m"}
    if rng.random() < 0.6:
        body["prompt"] = _text(rng) if rng.random() < 0.5 else [_text(rng), 3, _value(rng, 2)]
    if rng.random() < 0.6:
        body["messages"] = [
            {"role": "user", "content": _text(rng) if rng.random() < 0.5 else [
                {"type": "text", "text": _text(rng)}, _value(rng, 3)]}
            for _ in range(rng.randrange(3))
        ]  # fmt: skip
    for _ in range(rng.randrange(3)):
        body[_text(rng)] = _value(rng, 1)
    return body


def _chars(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    chars = sum(len(t) for t in texts if isinstance(t, str))
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        chars += message_chars(messages)
    return chars


def test_the_bounds_hold_on_random_bodies_in_every_spelling() -> None:
    rng = random.Random(7)
    read = 0
    for _ in range(3000):
        body = _body(rng)
        spelled = json.dumps(body, ensure_ascii=rng.random() < 0.5,
                             indent=rng.choice([None, 1, 2])).encode()  # fmt: skip
        bounds = text_bounds(spelled, PATHS)
        assert bounds is not None, spelled  # well-formed and small: always read
        least, most = bounds
        assert least <= _chars(body) <= most, (spelled, bounds, _chars(body))
        read += 1
    assert read == 3000


def test_it_gives_up_on_what_is_not_one_json_object() -> None:
    rng = random.Random(11)
    for _ in range(2000):
        spelled = json.dumps(_body(rng)).encode()
        cut = spelled[: rng.randrange(len(spelled))]  # truncated
        assert text_bounds(cut, PATHS) is None, cut
    for bad in (b"", b"[]", b'"prompt"', b"12", b'{"prompt": "x"} {}', b'{"prompt": "x"]',
                b'{"prompt": "unterminated', b"\x00\x01"):  # fmt: skip
        assert text_bounds(bad, PATHS) is None, bad
    many = b'{"x": [' + b'"a",' * 30_000 + b'"a"], "prompt": "p"}'
    assert text_bounds(many, PATHS) is None  # past the budget: left to the parser


def test_a_30_mb_prompt_is_bounded_without_being_decoded() -> None:
    huge = "word " * 6_000_000
    for body, paths in (({"prompt": huge}, _TEXT_PATHS["prompt"]),
                        ({"messages": [{"role": "user", "content": huge}]},
                         _TEXT_PATHS["messages"])):  # fmt: skip
        assert text_bounds(json.dumps(body).encode(), paths) == (2_500_000, 30_000_000)
