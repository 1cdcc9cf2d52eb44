"""transfer: a NIXL-like KV transport between prefill and decode workers.

The layer knows regions and bytes, not models: the engine says which byte
ranges a KV block occupies, and the transfer layer moves them.

Concepts
--------
* `Agent`: one per worker process, with a name and a fresh `incarnation`
  (and secret) on every start. It owns the backends, the registered memory and
  the table of trusted peers. See Usage below.
* `Region`: registered memory, from `Agent.allocate` (shared memory on shm
  agents, so a same-host peer maps the KV pool directly) or `Agent.register`
  (a tensor or buffer the caller owns). `Region.tensor()` wraps it for torch.
* `DescList`: ordered (region, offset, length) ranges; `DescList.blocks`
  builds them for a block-major KV pool; adjacent ranges coalesce. A transfer
  moves the local list's bytes, as one stream, onto the remote list.
  `Agent.prepare` / `prepare_remote` check a list once for reuse.
* `Agent.write` / `read` / `notify` return a `TransferHandle` (`poll()`,
  ``await wait()``, `result()`); the receiver gets a `Notification` through
  ``async for n in agent.notifications()``, once, after the data.
* Metadata (`Agent.metadata()` -> bytes) is what discovery publishes; a peer
  is trusted only after `Agent.add_remote(metadata)`.

Backends: shm, tcp, nixl, ucx, and auto (see `transfer.backends`).

Usage
-----
A decode worker (receiver) and a prefill worker (writer)::

    agent = Agent("decode-0", backend="auto", layout=kv_layout.layout_hash)
    pool = agent.allocate(num_blocks * block_bytes)      # the KV pool, registered
    kv = pool.tensor(torch.bfloat16, (num_blocks, ...))   # handed to the engine
    publish(agent.metadata())                             # discovery (etcd)
    for md in prefill_workers: agent.add_remote(md)       # only these may write
    async for note in agent.notifications(): ...          # each after its data

    agent = Agent("prefill-3", backend="auto")
    src = agent.register(kv_pool_tensor)                  # or allocate() it here
    agent.add_remote(decode_md, expect_layout=my_layout)
    h = agent.write(DescList.blocks(src, my_blocks, block_bytes), "decode-0",
                    DescList.blocks(0, their_blocks, block_bytes),
                    notification=b'{"request": "r-17", "first_token": 42}')
    await h.wait()                                        # raises if it failed

`Agent.stats()` counts bytes, transfers and every refusal by reason, for the
``diptych_transfer_*`` metrics.

Threads: callers never block on I/O. Each peer link has a writer thread (copies,
socket writes) and a reader thread (replies); each accepted connection has a
reader thread; ucx adds one UCX progress thread and nixl one NIXL poller. Handles
complete on those threads and wake awaiting event loops thread-safely. NIXL and
UCX listen on every interface: tests run them in a private network namespace
(`transfer.testing`) and keep in-process agents to ``backend=("shm", "tcp")``.

Safety model
------------
* Only added peers are served: every connection is mutually authenticated by
  HMAC proofs of the secrets carried in the metadata (`transfer.handshake`);
  nixl notifications are signed with the same secrets.
* Every range is checked against the registered regions before a byte moves:
  by the initiator against what the peer advertised (and, for shm, the real
  segment size), and by the receiver on two-sided paths (tcp, ucx, and the shm
  notification). One-sided paths (nixl, shm copies) cannot be refused by the
  receiver; there the initiator's check, the backend's own registration check
  (NIXL refuses descriptors outside remote registrations) and the receiver's
  refusal to *deliver* an unauthenticated notification are what hold.
* Refusals are counted per reason (`Agent.stats()`).
* A peer that disconnects fails its pending handles at once; a new incarnation
  (`add_remote` of fresher metadata) invalidates every cached connection,
  mapping and prepared list of the old one.
* A layout hash travels in the metadata as an opaque string (the engine computes it:
  `protocol.kv_layout.KvLayout.layout_hash`); check it with
  ``add_remote(md, expect_layout=...)``.
"""

from transfer.agent import Agent
from transfer.context import AgentMetadata, RegionInfo
from transfer.descriptors import (
    Desc,
    DescList,
    Plan,
    Prepared,
    RankWrite,
    make_plan,
    rank_writes,
)
from transfer.errors import (
    AgentClosedError,
    AuthenticationError,
    BackendUnavailableError,
    DescriptorError,
    LayoutMismatchError,
    MetadataError,
    OutOfBoundsError,
    PeerDisconnectedError,
    PeerError,
    PeerRejectedError,
    PeerRemovedError,
    PeerRestartedError,
    PeerUnreachableError,
    ProtocolError,
    TransferError,
    UnknownPeerError,
)
from transfer.handle import Notification, TransferHandle, TransferState
from transfer.memory import Region
from transfer.shmseg import sweep_stale_segments

__all__ = [
    "Agent",
    "AgentClosedError",
    "AgentMetadata",
    "AuthenticationError",
    "BackendUnavailableError",
    "Desc",
    "DescList",
    "DescriptorError",
    "LayoutMismatchError",
    "MetadataError",
    "Notification",
    "OutOfBoundsError",
    "PeerDisconnectedError",
    "PeerError",
    "PeerRejectedError",
    "PeerRemovedError",
    "PeerRestartedError",
    "PeerUnreachableError",
    "Plan",
    "Prepared",
    "ProtocolError",
    "RankWrite",
    "Region",
    "RegionInfo",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "UnknownPeerError",
    "make_plan",
    "rank_writes",
    "sweep_stale_segments",
]
