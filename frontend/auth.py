"""API keys: with keys configured, every route but health, readiness and metrics needs
``Authorization: Bearer <key>`` (what the OpenAI clients send), else 401.

Keys come from ``--api-key`` (repeatable), ``--api-key-file`` (one per line, ``#``
comments) and the ``DIPTYCH_API_KEY`` environment variable (comma-separated); see
:func:`collect_api_keys`. Only SHA-256 digests are kept, and a presented key is compared
with each in constant time, so neither the keys' text nor their lengths leak through
timing; no key, presented or configured, is ever logged. A request that passes
carries its key's name in ``scope["state"]["api_key"]``: the first 12 hex digits of
the key's digest (:func:`key_name`), what per-key metrics and limits are labelled by.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Iterable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)

ENV_VAR = "DIPTYCH_API_KEY"
# Probes and scrapers (Kubernetes, Prometheus) do not carry keys; none of these says
# anything about a request or a prompt.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
MAX_KEY_LEN = 1024


def collect_api_keys(
    keys: Iterable[str] = (), files: Iterable[str] = (), env: str | None = None
) -> tuple[str, ...]:
    """The keys given directly, those in ``files`` and those in ``env`` (the value of
    ``DIPTYCH_API_KEY``), without duplicates; raises ValueError for an unusable key."""
    found: list[str] = [k.strip() for k in keys]
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ValueError(f"cannot read the API key file {path}: {e.strerror}") from None
        found += [s for line in lines if (s := line.strip()) and not s.startswith("#")]
    if env:
        found += [s for part in env.split(",") if (s := part.strip())]
    for k in found:
        if not k or len(k) > MAX_KEY_LEN or any(c.isspace() for c in k) or not k.isprintable():
            raise ValueError(
                f"an API key must be 1-{MAX_KEY_LEN} printable characters without spaces"
            )
    return tuple(dict.fromkeys(found))


def api_keys_from_env() -> str | None:
    return os.environ.get(ENV_VAR) or None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def key_name(key: bytes) -> str:
    """A key's name in metrics: a digest prefix, which says nothing of the key."""
    return _digest(key)[:6].hex()


class ApiKeys:
    """The accepted keys, as digests."""

    def __init__(self, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("ApiKeys needs at least one key")
        self._digests = [_digest(k.encode()) for k in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, presented: bytes) -> bool:
        d = _digest(presented)
        ok = False
        for known in self._digests:  # no early exit: the time does not say which matched
            ok |= hmac.compare_digest(d, known)
        return ok


def bearer_token(authorization: bytes) -> bytes | None:
    scheme, _, token = authorization.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


_UNAUTHORIZED = json.dumps(
    {
        "error": {
            "message": "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


class ApiKeyMiddleware:
    """Refuses, with the OpenAI 401 error body, any HTTP request outside
    :data:`OPEN_PATHS` that carries no accepted key; the app never sees it (nor its
    body)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        token = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                token = bearer_token(value)
                break
        if token is not None and self.keys.accepts(token):
            scope.setdefault("state", {})["api_key"] = key_name(token)
            await self.app(scope, receive, send)
            return
        log.info("refused %s %s: no valid API key", scope.get("method"), scope["path"])
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b'Bearer realm="diptych"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
