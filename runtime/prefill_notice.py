"""The notice a prefill worker sends to a decode worker when a remote prefill ends.

It travels as the transfer layer's notification, after the KV it announces:

* ``ok=True``: the KV of positions ``[num_cached_tokens, prompt length)`` is in the
  decode worker's blocks, and ``first_token`` (with its logprob when asked) was
  sampled from the prompt's last position.
* ``ok=False``: nothing was written and nothing will be (the deadline passed, the
  layout did not match...): the decode worker may reuse the blocks at once.

``prefill_s`` and ``transfer_s`` are the prefill worker's own timings, for the
breakdown of time to first token.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from runtime.errors import InvalidInput
from runtime.rpc.types import TokenLogprob, TopLogprob
from runtime.validation import check_request_id

SCHEMA_VERSION = 1
MAX_NOTICE_BYTES = 64 * 1024


@dataclass(frozen=True)
class PrefillNotice:
    request_id: str
    ok: bool
    first_token: int = -1
    logprob: TokenLogprob | None = None
    error: str = ""
    prefill_worker_id: str = ""
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transferred_bytes: int = 0

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        if self.ok and (isinstance(self.first_token, bool) or self.first_token < 0):
            raise InvalidInput("a successful prefill notice needs a first_token >= 0")

    def encode(self) -> bytes:
        d: dict[str, Any] = asdict(self)
        d["v"] = SCHEMA_VERSION
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> PrefillNotice:
        if len(data) > MAX_NOTICE_BYTES:
            raise InvalidInput(f"prefill notice of {len(data)} bytes is too large")
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidInput(f"malformed prefill notice: {e}") from None
        if not isinstance(d, dict) or d.get("v") != SCHEMA_VERSION:
            raise InvalidInput(f"prefill notice of unknown version: {str(d)[:80]}")
        lp = d.get("logprob")
        logprob = None
        if isinstance(lp, dict):
            top = tuple(TopLogprob(int(t["token_id"]), float(t["logprob"])) for t in lp["top"])
            logprob = TokenLogprob(float(lp["logprob"]), top)
        try:
            return cls(
                request_id=str(d["request_id"]),
                ok=bool(d["ok"]),
                first_token=int(d.get("first_token", -1)),
                logprob=logprob,
                error=str(d.get("error", "")),
                prefill_worker_id=str(d.get("prefill_worker_id", "")),
                prefill_s=float(d.get("prefill_s", 0.0)),
                transfer_s=float(d.get("transfer_s", 0.0)),
                transferred_bytes=int(d.get("transferred_bytes", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInput(f"malformed prefill notice: {e}") from None
