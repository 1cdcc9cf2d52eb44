"""A cheap look into a request body before it is parsed: the raw spans of the string
values at a few paths, found without decoding a string (a 30 MB prompt is one ``find``).

``text_bounds(body, paths)`` gives the fewest and the most characters the strings at
``paths`` can decode to: a JSON string literal of ``n`` raw bytes decodes to at most
``n`` characters and at least ``n / 12`` (the longest spelling of one character is a
surrogate pair, ``\\uD83D\\uDE00``), so a prompt whose literal is over twelve times the
character bound is over the bound without being decoded, and one shorter than the bound
is within it. The scan walks at most ``budget`` tokens and gives up (None) on a
body it cannot read cheaply or that is not well-formed JSON: the parser that follows then
decides, at its usual cost.

A path is a tuple of keys, ``"*"`` for any array element: ``("prompt",)``,
``("prompt", "*")``, ``("messages", "*", "content")``,
``("messages", "*", "content", "*", "text")``.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(rb'[ \t\r\n]*(?:(")|([{}\[\],:])|(-?[0-9][0-9.eE+-]*|true|false|null))')
MAX_BYTES_PER_CHAR = 12


def _string_end(body: bytes, start: int, budget: list[int]) -> int | None:
    """The index of the quote closing the literal that opens at ``start - 1``."""
    pos = start
    while budget[0] > 0:
        budget[0] -= 1
        quote = body.find(b'"', pos)
        if quote < 0:
            return None
        slashes = 0
        while body[quote - 1 - slashes] == 0x5C:  # backslashes escaping it, or each other
            slashes += 1
        if slashes % 2 == 0:
            return quote
        pos = quote + 1
    return None


def text_bounds(
    body: bytes, paths: tuple[tuple[str, ...], ...], budget: int = 20_000
) -> tuple[int, int] | None:
    """(fewest, most) characters the string values at ``paths`` decode to, together; None
    when the body cannot be read cheaply (the caller then parses it)."""
    wanted = {tuple(p.encode() for p in path) for path in paths}
    left = [budget]
    # one frame per open container: [is_object, key or None, expecting a key]
    stack: list[list[object]] = []
    pos, least, most = 0, 0, 0
    while left[0] > 0:
        left[0] -= 1
        m = _TOKEN.match(body, pos)
        if m is None:
            return None
        pos = m.end()
        if m.group(1):  # a string: a key, or a value
            end = _string_end(body, pos, left)
            if end is None:
                return None
            if stack and stack[-1][0] and stack[-1][2]:
                stack[-1][1], stack[-1][2] = body[pos:end], False
            elif _path(stack) in wanted:
                least += -(-(end - pos) // MAX_BYTES_PER_CHAR)
                most += end - pos
            pos = end + 1
            if not stack:
                return None  # a bare string, not an object
        elif m.group(2):
            c = m.group(2)
            if c in (b"{", b"["):
                if not stack and c == b"[":
                    return None  # a request body is an object
                stack.append([c == b"{", None, c == b"{"])
            elif c in (b"}", b"]"):
                if not stack or stack[-1][0] != (c == b"}"):
                    return None
                stack.pop()
                if not stack:
                    return (least, most) if body[pos:].strip() == b"" else None
            elif c == b",":
                if not stack:
                    return None
                stack[-1][2] = bool(stack[-1][0])  # an object's next key
            # ":" needs nothing: the key was taken with its string
        elif not stack:
            return None  # a bare number or literal
    return None


def _path(stack: list[list[object]]) -> tuple[bytes, ...]:
    """The path of the value about to be read, ``*`` for array elements."""
    out = []
    for is_object, key, _ in stack:
        out.append(key if is_object else b"*")
    return tuple(out)  # type: ignore[arg-type]
