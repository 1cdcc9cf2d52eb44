"""KV tiers through a SIGKILL on real processes (issue 40): `diptych serve` with two decode
workers on the default model in fp32, a device pool too small for the prompts, a host
tier and a disk tier the two share. Long prompts are served once, one at a time (their
blocks leave the device pools for the tiers); then all at once again, their prefixes
copied back from the tiers, and the busiest worker is SIGKILLed while its pool evicts
into the tiers and restores from them. Every stream completes through the official
openai client with the text of the first run (a stale or torn block would change it);
the survivor's pool is back to idle. A second `diptych serve` on the same disk
directory finds the blocks the killed fleet wrote, restores them and answers the same;
whatever the kill cut short is refused, never served."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import REPORT
from tests.e2e import serving
from tests.e2e.serving import STREAM_PROMPTS, Server, greedy_stream

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
# long, distinct prompts: about 150 tokens (10 blocks) each, so that two of them overflow
# a worker's 15 usable blocks and the first one's prefix goes to the tiers
NOTE = "note {i}.{j} says item {a} comes before item {b}."
PROMPTS = [
    p + " Keep to these notes: "
    + " ".join(NOTE.format(i=i, j=j, a=j * 7 % 13, b=j * 5 % 11) for j in range(9))
    for i, p in enumerate(STREAM_PROMPTS)
]


def _flags(disk: Path) -> tuple[str, ...]:
    return (
        "--prefill-workers", "0", "--decode-workers", "2", "--dtype", "float32",
        "--num-blocks", "16", "--kv-host-memory", "0.004",  # about 5 blocks of host tier
        "--kv-disk-dir", str(disk), "--kv-disk-gib", "1",
    )  # fmt: skip


def _tier_sum(server: Server, workers: list[str], name: str) -> float:
    return sum(server.metrics(w)[f"diptych_worker_kv_tier_{name}_total"] for w in workers)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, disk: Path) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("tiers-kill"), *_flags(disk))
    yield server
    server.stop()


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _one_at_a_time(server: Server) -> list[tuple[str, str]]:
    client = _client(server)
    return [greedy_stream(client, p, MAX_TOKENS, [0], 0) for p in PROMPTS]


@pytest.fixture(scope="module")
def first_run(fleet: Server) -> list[tuple[str, str]]:
    out = _one_at_a_time(fleet)
    assert all(f == "length" for _, f in out)
    workers = ["decode-0", "decode-1"]
    assert _tier_sum(fleet, workers, "offloaded_blocks") > 0, "nothing left the device pools"
    return out


def test_a_worker_killed_while_its_tiers_move_blocks_fails_no_stream(
    fleet: Server, first_run: list[tuple[str, str]]
) -> None:
    workers = ["decode-0", "decode-1"]
    restored_before = _tier_sum(fleet, workers, "restored_blocks")

    at_kill: list[float] = []

    def kill() -> None:  # (the restores both workers made so far, then the kill)
        at_kill.append(_tier_sum(fleet, workers, "restored_blocks"))
        serving.kill_a_busy_worker(fleet, workers)

    results = serving.streams_through_a_kill(_client(fleet), PROMPTS, MAX_TOKENS, kill, under_way=4,
                                             server=fleet)
    assert results == first_run, [r if isinstance(r, BaseException) else r[1] for r in results]
    front = serving.scrape(fleet.url)
    assert front["diptych_frontend_stream_errors_total"] == 0
    assert front['diptych_frontend_failovers_total{kind="migration"}'] >= 1
    survivor = fleet.metrics(workers[0])
    assert survivor["diptych_worker_kv_used_blocks"] == 0.0  # nothing leaked
    restored = _tier_sum(fleet, workers, "restored_blocks")
    REPORT["KV tiers through a SIGKILL: the survivor's blocks offloaded / restored"] = (
        f"{_tier_sum(fleet, workers, 'offloaded_blocks'):.0f} / {restored:.0f} "
        f"({restored_before:.0f} restored before the kill run, {at_kill[0]:.0f} by both "
        "workers at the kill)"
    )
    # the second run's prefixes came back from the tiers: on either worker before the
    # kill, or on the survivor (which one holds which prefix is the router's choice)
    assert max(at_kill[0], restored) > restored_before


def test_a_new_fleet_restores_what_the_killed_one_left_on_disk(
    tmp_path: Path, disk: Path, fleet: Server, first_run: list[tuple[str, str]]
) -> None:
    fleet.stop()  # (the module's fleet, its worker already killed)
    files = list(disk.rglob("*.kv"))
    assert files, "the disk tier holds nothing"
    again = Server(tmp_path / "again", *_flags(disk))
    try:
        assert _one_at_a_time(again) == first_run
        workers = ["decode-0", "decode-1"]
        reads = _tier_sum(again, workers, "disk_reads")
        rejected = _tier_sum(again, workers, "disk_rejected")
        REPORT["KV tiers after the kill: a new fleet's disk reads / files refused / on disk"] = (
            f"{reads:.0f} / {rejected:.0f} / {len(files)}"
        )
        assert reads > 0  # the killed fleet's blocks, found and checked
        # a file the kill cut short is refused (counted), never served: the texts above
    finally:
        assert again.stop() == 0
