"""The prefill notice: encoding, validation on receipt, and what a malformed one carries."""

from __future__ import annotations

import json

import pytest

from protocol.logprobs import TokenLogprob, TopLogprob
from runtime.queue.messages import NOTICE_VERSION, MalformedNotice, PrefillNotice


def _ok() -> PrefillNotice:
    lp = TokenLogprob(7, -0.25, 1, (TopLogprob(7, -0.25), TopLogprob(9, -1.5)))
    return PrefillNotice(
        "r-1", ok=True, first_token=7, logprob=lp, prefill_worker_id="prefill-0",
        prefill_s=0.125, write_started_at=1_800_000_000.5, transferred_bytes=4096,
    )  # fmt: skip


def test_roundtrip_and_version() -> None:
    sent = _ok()
    data = sent.encode()
    assert json.loads(data)["v"] == NOTICE_VERSION == 3
    assert PrefillNotice.decode(data) == sent
    refused = PrefillNotice("r-2", ok=False, error="deadline too close")
    assert PrefillNotice.decode(refused.encode()) == refused


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logprob": [7, "x", 1, []]}, "logprob"),  # once outside the try: crashed
        ({"logprob": [7, -1.0, 1, [["7", 0.0]]]}, "token id"),
        ({"logprob": [7, -1.0, 1, 3]}, "logprob"),
        ({"logprob": [1, 2]}, "logprob"),
        ({"logprob": [8, -1.0, 1, []]}, "another token"),
        ({"logprob": [7, float("nan"), 1, []]}, "logprob"),
        ({"first_token": -1}, "first_token"),
        ({"first_token": True}, "first_token"),
        ({"ok": "yes"}, "ok"),
        ({"prefill_s": float("nan")}, "prefill_s"),
        ({"write_started_at": -5}, "write_started_at"),
        ({"transferred_bytes": 1.5}, "transferred_bytes"),
        ({"v": 2}, "version 2"),
    ],
)
def test_malformed_notices_raise_with_the_request_id(
    change: dict[str, object], message: str
) -> None:
    d = json.loads(_ok().encode())
    d.update(change)
    with pytest.raises(MalformedNotice, match=message) as err:
        PrefillNotice.decode(json.dumps(d).encode())
    assert err.value.request_id == "r-1"  # enough to settle that one request


@pytest.mark.parametrize("data", [b"", b"{", b"[1]", b'"x"', b"\xff\xfe", b"{}" + b" " * 70_000])
def test_unreadable_notices_raise_without_an_id(data: bytes) -> None:
    with pytest.raises(MalformedNotice) as err:
        PrefillNotice.decode(data)
    assert err.value.request_id is None


def test_a_request_id_of_the_wrong_type_is_not_trusted() -> None:
    d = json.loads(_ok().encode())
    d["request_id"] = 12
    with pytest.raises(MalformedNotice) as err:
        PrefillNotice.decode(json.dumps(d).encode())
    assert err.value.request_id is None
