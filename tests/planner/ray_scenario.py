"""The Ray connector's scenario, run by test_ray_connector.py in a private network
namespace (Ray binds every interface): a real local Ray cluster, simulated decode
and prefill workers as actors on the embedded control plane, scaled up, down,
adopted by a second connector, and to zero. Prints one JSON line of what it saw.

    python tests/planner/ray_scenario.py <work dir>
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray

from planner.connectors.ray import RayConnector
from runtime.discovery import DiscoveryOptions, EmbeddedDiscovery


async def registered(discovery: EmbeddedDiscovery) -> dict[str, list[str]]:
    return {
        pool: sorted(w.worker_id for w in await discovery.list(pool))
        for pool in ("prefill", "decode")
    }


async def until(discovery: EmbeddedDiscovery, want: dict[str, int], timeout: float) -> float:
    """Seconds until discovery lists `want` workers per pool."""
    t0 = time.monotonic()
    while True:
        seen = await registered(discovery)
        if all(len(seen[p]) == n for p, n in want.items()):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"wanted {want}, discovery lists {seen}")
        await asyncio.sleep(0.5)


async def main(work: Path) -> dict[str, Any]:
    state = work / "state"
    state.mkdir(parents=True, exist_ok=True)
    # Ray's socket paths must stay under 107 bytes: a short temporary dir of its own
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, namespace="diptych-test",
             _temp_dir=temp, log_to_driver=False)  # fmt: skip
    try:
        return await _scenario(work, state)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


async def _scenario(work: Path, state: Path) -> dict[str, Any]:
    flags = f"--engine sim --profile H100:Llama-3.1-8B --state-dir {state} --drain-timeout 10"
    opts = {"num_cpus": 0}
    out: dict[str, Any] = {}
    async with EmbeddedDiscovery(state, DiscoveryOptions(ttl=5)) as discovery:
        first = RayConnector(None, flags, actor_options=opts, namespace="diptych-test")
        await first.scale("decode", 2)
        await first.scale("prefill", 1)
        out["up_s"] = await until(discovery, {"decode": 2, "prefill": 1}, 180)
        out["up"] = await registered(discovery)
        await first.scale("decode", 1)  # the newest drains, leaves, is killed
        out["down_s"] = await until(discovery, {"decode": 1, "prefill": 1}, 60)
        out["after_down"] = await registered(discovery)
        end = time.monotonic() + 60
        while first.draining() and time.monotonic() < end:
            await asyncio.sleep(0.5)
        out["draining_left"] = first.draining()
        await first.close()
        # a restarted planner adopts the running actors instead of starting more
        second = RayConnector(None, flags, actor_options=opts, namespace="diptych-test")
        await second.scale("decode", 1)
        await second.scale("prefill", 1)
        out["adopted"] = second.members()
        out["named_actors"] = sorted(
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "diptych-test"
        )  # fmt: skip
        await second.scale("prefill", 0)
        await second.scale("decode", 0)
        out["zero_s"] = await until(discovery, {"decode": 0, "prefill": 0}, 60)
        end = time.monotonic() + 60
        while second.draining() and time.monotonic() < end:
            await asyncio.sleep(0.5)
        out["draining_at_zero"] = second.draining()
    return out


if __name__ == "__main__":
    result = asyncio.run(main(Path(sys.argv[1])))
    print("RESULT " + json.dumps(result), flush=True)
