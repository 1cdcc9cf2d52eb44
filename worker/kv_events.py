"""A worker's prefix cache as KV events: what both roles publish for routers.

A decode worker's events feed the frontends' KV-aware routers; a prefill worker's feed
the decode workers, which prefer the prefill worker holding most of a prompt. The
engine notes every block stored in or evicted from its prefix cache; after each step
(on the engine thread) `publish_step` hands them to the role's `KvEventPublisher`,
whose subscribers get a snapshot and then these changes, numbered.
"""

from __future__ import annotations

from engine.engine_core import EngineCore
from runtime.rpc.events import KvEventPublisher


def publish_step(core: EngineCore, events: KvEventPublisher) -> None:
    """Forward what the prefix cache stored and evicted since the last call."""
    for kind, hashes in core.drain_kv_events():
        if kind == "stored":
            events.stored(hashes)
        else:
            events.removed(hashes)
