"""How a request's output ends."""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # aborted (a cancelled client, a drained worker)
    ERROR = "error"  # failed; the error says why
