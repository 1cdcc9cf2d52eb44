"""The messages of a prefix pull between decode workers (decode_worker/peer_kv.py): what
one side encodes the other decodes unchanged, and a malformed one (from a buggy or
hostile peer) is refused with InvalidInput, never half-read."""

from __future__ import annotations

import json
from typing import Any

import pytest

from decode_worker.peer_kv import MARK, KvPull, KvPulled, decode_message
from protocol.errors import InvalidInput

PULL = KvPull("r-1", (1, 2**64 - 1), (5, 6), "ab" * 16, "layout", 1.5e9)


def test_messages_round_trip_and_carry_their_mark() -> None:
    for message in (PULL, KvPulled("r-1", 2), KvPulled("r-1", 0, "none held")):
        data = message.encode()
        assert data.startswith(MARK)
        assert decode_message(data) == message


def _pull(**change: Any) -> bytes:
    d = json.loads(PULL.encode())
    d.update(change)
    return json.dumps(d).encode()


@pytest.mark.parametrize("data", [
    b"not json", b"[]", _pull(v=2), _pull(peer_kv="push"),
    _pull(hashes=[1]),  # fewer hashes than blocks
    _pull(hashes=[1, -2]), _pull(hashes=[1, 2**64]), _pull(hashes=[True, 1]),
    _pull(dst_block_ids=[5, 2**31]), _pull(dst_block_ids="56"),
    _pull(grant=7), _pull(deadline=True), _pull(deadline="soon"), _pull(deadline=float("nan")),
    _pull(request_id="has space"), _pull(hashes=list(range(70_000)),
                                         dst_block_ids=list(range(70_000))),
    json.dumps({"peer_kv": "pulled", "v": 1, "request_id": "r", "blocks": -1}).encode(),
    json.dumps({"peer_kv": "pulled", "v": 1, "request_id": "r", "blocks": 1,
                "error": 3}).encode(),
])  # fmt: skip
def test_a_malformed_message_is_refused(data: bytes) -> None:
    with pytest.raises(InvalidInput):
        decode_message(data)
