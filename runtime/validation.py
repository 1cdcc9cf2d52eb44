"""Checks for the identifiers that travel through keys, subjects and headers.

Worker ids, roles and namespaces end up in etcd keys, NATS subjects and stream names, so
they are restricted to characters that are safe in all three. Request ids come from
clients (``chatcmpl-...``) and only need to be printable ASCII, which is what NATS headers
accept.
"""

from __future__ import annotations

import json
import re
from typing import Any

from protocol.declare import check_fields
from runtime.errors import ConfigError, InvalidInput

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")

MAX_TOKEN_ID = 2**31 - 1


def check_name(what: str, value: object) -> str:
    """A namespace or role: lower-case letters, digits, ``_`` and ``-``, at most 63 chars."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidInput(
            f"{what} must be 1-63 characters of [a-z0-9_-] starting with a letter or digit, "
            f"got {value!r}"
        )
    return value


def check_worker_id(value: object, what: str = "worker_id") -> str:
    if not isinstance(value, str) or not _WORKER_ID.fullmatch(value):
        raise InvalidInput(
            f"{what} must be 1-128 characters of [A-Za-z0-9_-] starting with a letter or "
            f"digit, got {value!r}"
        )
    return value


def check_request_id(value: object) -> str:
    if not isinstance(value, str) or not _REQUEST_ID.fullmatch(value):
        raise InvalidInput(
            f"request_id must be 1-256 printable ASCII characters without spaces, got {value!r}"
        )
    return value


def check_token_ids(what: str, ids: object, *, allow_empty: bool = False) -> tuple[int, ...]:
    """Token ids as a tuple of ints in ``[0, 2**31)``; rejects bools and other types."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise InvalidInput(f"{what} must be a sequence of token ids, got {type(ids).__name__}")
    out = tuple(ids)
    if not out:
        if allow_empty:
            return out
        raise InvalidInput(f"{what} must not be empty")
    # C-speed checks first: prompts can hold 100k+ tokens.
    if not (set(map(type, out)) == {int} and min(out) >= 0 and max(out) <= MAX_TOKEN_ID):
        for i, t in enumerate(out):
            if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
                raise InvalidInput(f"{what}[{i}] = {t!r} is not a token id in [0, {MAX_TOKEN_ID}]")
    return out


def json_object(
    data: bytes | str, what: str, max_bytes: int, error: type[InvalidInput] = InvalidInput
) -> dict[str, Any]:
    """`data` parsed as a JSON object of at most `max_bytes`; otherwise raises `error`
    (InvalidInput or a subclass) with a reason that names `what`."""
    if len(data) > max_bytes:
        raise error(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit")
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{what} is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise error(f"{what} must be a JSON object")
    return d


def check_options(options: Any) -> None:
    """Check an options dataclass against its fields' declarations
    (`protocol.declare.spec`); what is out of range is a ConfigError."""
    try:
        check_fields(options)
    except InvalidInput as e:
        raise ConfigError(str(e)) from None
