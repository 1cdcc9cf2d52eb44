"""Signed prefill-queue messages: who may put work on the queue, and when.

With a deployment secret, every message a queue client writes (a remote-prefill
request, a dead letter) is sealed::

    b"DQS1" | kind u8 | signed_at f64 | nonce (16 bytes) | body | HMAC-SHA256(key, all before)

``key`` is the queue's own key derived from the deployment secret
(``runtime/secret.py``), ``kind`` says which message the body is (a request cannot
pass as a dead letter), ``signed_at`` is the writer's clock. A reader holding the key
opens a message only if the MAC verifies; a request is further refused when it was
signed more than ``MAX_SKEW_S`` ahead of the reader's clock, and a nonce seen before
at another stream position is a replay (a redelivery of one message keeps its
position; a re-publish by whoever recorded the bytes gets a new one). Nonces are
remembered until their request's deadline: past it a request is stale and the queue
dead-letters it without work (``DEADLINE``), so the memory is bounded by the deadlines.

Without a key, messages are written and read unsealed, as before; a reader with a key
refuses an unsealed message (``unsigned``).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass

from runtime.errors import InvalidInput

MAGIC = b"DQS1"
_HEAD = struct.Struct("<4sBd16s")
_MAC = 32
MAX_SKEW_S = 30.0  # how far ahead of the reader's clock a writer's may be
MAX_NONCES = 1_000_000  # a bound on the replay memory whatever the deadlines


class Kind(enum.IntEnum):
    REQUEST = 1
    DEAD_LETTER = 2


REJECTIONS = ("unsigned", "bad_signature", "wrong_kind", "future", "replayed")


class Rejected(InvalidInput):
    """A message that does not open; ``reason`` is one of :data:`REJECTIONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class Opened:
    body: bytes
    signed_at: float
    nonce: bytes


def seal(key: bytes, kind: Kind, body: bytes, now: float | None = None) -> bytes:
    head = _HEAD.pack(MAGIC, kind, time.time() if now is None else now, secrets.token_bytes(16))
    signed = head + body
    return signed + hmac.new(key, signed, hashlib.sha256).digest()


def open_sealed(key: bytes, kind: Kind, data: bytes) -> Opened:
    """The body of a sealed message of ``kind``; raises :class:`Rejected`."""
    data = bytes(data)
    if len(data) < _HEAD.size + _MAC or data[:4] != MAGIC:
        raise Rejected("unsigned", f"a {len(data)}-byte message without a signature")
    signed, mac = data[:-_MAC], data[-_MAC:]
    if not hmac.compare_digest(hmac.new(key, signed, hashlib.sha256).digest(), mac):
        raise Rejected("bad_signature", "the signature does not verify with this deployment's key")
    _, got, signed_at, nonce = _HEAD.unpack_from(signed)
    if got != kind:
        raise Rejected("wrong_kind", f"a message of kind {got} where {kind.name} was expected")
    return Opened(signed[_HEAD.size :], signed_at, nonce)


class ReplayGuard:
    """Which nonces this reader has seen, at which stream position, until when."""

    def __init__(self, limit: int = MAX_NONCES) -> None:
        self._seen: OrderedDict[bytes, tuple[int, float]] = OrderedDict()
        self._limit = limit

    def check(self, opened: Opened, position: int, deadline: float, now: float) -> None:
        """Refuse a request signed in the future, or replayed. (One past its deadline is
        the queue's to dead-letter: it is genuine, and its nonce may be forgotten.)"""
        if opened.signed_at > now + MAX_SKEW_S:
            raise Rejected("future", f"signed {opened.signed_at - now:.0f} s ahead of this clock")
        self._expire(now)
        seen = self._seen.get(opened.nonce)
        if seen is not None and seen[0] != position:
            raise Rejected("replayed", f"first seen at position {seen[0]}, now at {position}")
        self._seen[opened.nonce] = (position, deadline)
        while len(self._seen) > self._limit:
            self._seen.popitem(last=False)

    def _expire(self, now: float) -> None:
        # entries are in first-seen order, which deadlines roughly follow: drop from the
        # front while they are past, leave a later-expiring straggler for a later call
        while self._seen:
            nonce, (_, deadline) = next(iter(self._seen.items()))
            if deadline >= now:
                return
            del self._seen[nonce]

    def __len__(self) -> int:
        return len(self._seen)
