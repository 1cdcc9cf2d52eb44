"""A generated token's logprob, its rank, and the most likely alternatives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from protocol.errors import InvalidInput

MAX_TOP = 20  # alternatives a token carries (the OpenAI API's limit)


class TopLogprob(NamedTuple):
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Built by the sampler on every sampled token, so it checks nothing itself: a peer's
    copy is checked when decoded (:meth:`from_plain`)."""

    token_id: int
    logprob: float
    rank: int = 0  # 1 for the most likely token; 0 when not known
    top: tuple[TopLogprob, ...] = ()

    def to_plain(self) -> list[Any]:
        """Compact: [token_id, logprob, rank, [[id, logprob], ...]]."""
        return [self.token_id, self.logprob, self.rank, [list(t) for t in self.top]]

    @classmethod
    def from_plain(cls, raw: Any) -> TokenLogprob:
        if not isinstance(raw, list) or len(raw) != 4 or not isinstance(raw[3], list):
            raise InvalidInput("a logprob must be [token_id, logprob, rank, top]")
        token_id, logprob, rank, top = raw
        if len(top) > MAX_TOP:
            raise InvalidInput(f"a logprob carries at most {MAX_TOP} alternatives")
        return cls(
            _token(token_id),
            _logprob(logprob),
            _token(rank),
            tuple(TopLogprob(*_pair(t)) for t in top),
        )


def _token(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < 2**31:
        raise InvalidInput(f"a logprob's token id or rank must be in [0, 2**31), got {x!r}")
    return x


def _logprob(x: Any) -> float:
    # -inf is a real logprob (a token a grammar masked), NaN and +inf are not
    if isinstance(x, bool) or not isinstance(x, (int, float)) or x != x or x == math.inf:
        raise InvalidInput(f"a logprob must be a number <= 0 or -inf, got {x!r}")
    return float(x)


def _pair(t: Any) -> tuple[int, float]:
    if not isinstance(t, list) or len(t) != 2:
        raise InvalidInput("a top logprob must be [token_id, logprob]")
    return _token(t[0]), _logprob(t[1])
