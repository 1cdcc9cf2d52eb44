"""Bounds on what an output constraint may ask of the grammar engine, checked at admission.

llguidance builds its lexer lazily, so a grammar that compiles may still blow up while
the request generates: the regex ``(x{1000}){1000}`` validated, then failed after a few
tokens ("too many expressions constructed"). Counted repetition is what multiplies the
lexer's states, so a regex (a ``regex`` constraint, or a JSON schema's ``pattern``) is
refused when its nested repeat counts multiply past :data:`MAX_REPEAT`, and a JSON
schema when a length or count keyword exceeds it. The 400 names the limit.
"""

from __future__ import annotations

import re
from typing import Any

try:  # Python 3.11+
    import re._constants as _sre_c  # type: ignore[import-not-found,unused-ignore]
    import re._parser as _sre  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - 3.10
    import sre_constants as _sre_c  # type: ignore[no-redef,unused-ignore]
    import sre_parse as _sre  # type: ignore[no-redef,unused-ignore]

from frontend.errors import BadRequest

MAX_REPEAT = 10_000
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_REPEATS = (_sre_c.MAX_REPEAT, _sre_c.MIN_REPEAT, getattr(_sre_c, "POSSESSIVE_REPEAT", None))


def check_regex(pattern: str, param: str) -> None:
    """Refuse a regex whose counted repetitions multiply past :data:`MAX_REPEAT`."""
    try:
        parsed = _sre.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return  # not Python's dialect: llguidance's validation has the last word
    product = _repeat_product(parsed)
    if product > MAX_REPEAT:
        raise BadRequest(
            f"{param}: the pattern {pattern[:80]!r} repeats up to {product} times in a row "
            f"(nested counts multiplied), over the limit of {MAX_REPEAT}",
            param=param,
            code="grammar_too_complex",
        )


def _repeat_product(items: Any) -> int:
    worst = 1
    for op, arg in items:
        if op in _REPEATS and op is not None:
            low, high, sub = arg
            count = low if high == _sre_c.MAXREPEAT else high
            worst = max(worst, max(count, 1) * _repeat_product(sub))
        elif op == _sre_c.SUBPATTERN:
            worst = max(worst, _repeat_product(arg[-1]))
        elif op == _sre_c.BRANCH:
            worst = max([worst, *(_repeat_product(b) for b in arg[1])])
    return worst


def check_schema(schema: Any, param: str, depth: int = 0) -> None:
    """Refuse a JSON schema with a count over :data:`MAX_REPEAT` or an over-repeating
    ``pattern``, anywhere in it."""
    if depth > 64:
        raise BadRequest(f"{param}: the schema nests deeper than 64 levels", param=param,
                         code="grammar_too_complex")  # fmt: skip
    if isinstance(schema, list):
        for item in schema:
            check_schema(item, param, depth + 1)
        return
    if not isinstance(schema, dict):
        return
    for key in _COUNTS:
        value = schema.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_REPEAT:
            raise BadRequest(
                f"{param}: {key} {value:g} is over the limit of {MAX_REPEAT}",
                param=param,
                code="grammar_too_complex",
            )
    if isinstance(schema.get("pattern"), str):
        check_regex(schema["pattern"], param)
    for value in schema.values():
        if isinstance(value, (dict, list)):
            check_schema(value, param, depth + 1)
