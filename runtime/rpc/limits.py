"""Size limits, in-flight caps and keepalives of the request plane, and why these values.

Message size (8 MiB both ways). The largest message is a GenerateRequest: token ids are
packed varints of 3 bytes each for today's vocabularies (< 2**21 ids) and at most 5, so
8 MiB holds a prompt of 1.6M to 2.8M tokens, above ``max_prompt_tokens`` (2**20) with
room to spare. gRPC's 4 MiB default would cut 1M-token contexts off at some vocabularies.
Responses are small (a chunk is a few tokens; Events snapshots are split into parts of
``snapshot_part_hashes`` = 16384 hashes, about 150 KB). A larger message is refused by gRPC
with RESOURCE_EXHAUSTED before any handler runs.

In-flight cap (``max_inflight_requests`` = 1024 Generate streams per worker). A decode
batch runs a few hundred sequences; beyond about twice that, a request only waits in the
worker's queue, where the frontend cannot move it. Past the cap the worker answers
RESOURCE_EXHAUSTED at once and the frontend routes elsewhere. Memory stays bounded: 1024
prompts at the size limit. The decode worker's handler enforces it, in its one capacity
gate (`DecodeHandler._admit`, beside its bound on queued requests); this layer only
sizes the transport by it.

HTTP/2 streams per connection (``max_concurrent_streams`` = 2048). The frontend multiplexes
all its requests to one worker over one connection; the stream limit sits above the
in-flight cap plus event subscribers, so the worker's explicit RESOURCE_EXHAUSTED is what
a client meets, never a silent wait for a free stream inside gRPC.

Keepalive. Clients ping every 10 s and drop a connection that does not answer within 5 s,
so a frontend notices a dead decode worker (power loss, partition: no TCP reset) within
15 s and migrates its streams; the server accepts pings every 5 s or slower and pings idle
clients itself every 30 s. Reconnection backoff is capped at 1 s so a restarted worker is
found quickly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.declare import check_fields, spec

MiB = 1024 * 1024


def _message_size_options(max_bytes: int) -> list[tuple[str, Any]]:
    """The largest message a channel or server takes and sends: the same both ways."""
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
    ]


@dataclass(frozen=True)
class ServerLimits:
    max_message_bytes: int = spec(8 * MiB, lo=1024, help="largest message, either way")
    max_prompt_tokens: int = spec(1 << 20, lo=1)
    max_inflight_requests: int = spec(1024, lo=1, help="Generate streams a worker serves")
    max_concurrent_streams: int = spec(2048, lo=1, help="HTTP/2 streams a connection")
    max_event_subscribers: int = spec(64, lo=0)
    snapshot_part_hashes: int = spec(16384, lo=1, help="block hashes an Events part")
    abort_grace_s: float = spec(2.0, lo=0.0)
    health_timeout_s: float = spec(2.0, lo=0.0, lo_open=True)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_concurrent_streams <= self.max_inflight_requests + self.max_event_subscribers:
            raise ValueError(
                "max_concurrent_streams must exceed max_inflight_requests + max_event_subscribers"
            )
        if self.snapshot_part_hashes * 10 > self.max_message_bytes // 2:
            raise ValueError("snapshot_part_hashes is too large for max_message_bytes")

    @property
    def max_concurrent_rpcs(self) -> int:
        # A hard backstop above the explicit caps (Health and Abort need headroom).
        return self.max_inflight_requests + self.max_event_subscribers + 256

    def server_options(self) -> list[tuple[str, Any]]:
        return [
            *_message_size_options(self.max_message_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.http2.max_ping_strikes", 0),
            # Two workers must never share a port by accident.
            ("grpc.so_reuseport", 0),
        ]


@dataclass(frozen=True)
class ClientOptions:
    max_message_bytes: int = 8 * MiB
    keepalive_time_ms: int = 10_000
    keepalive_timeout_ms: int = 5_000
    max_reconnect_backoff_ms: int = 1_000
    connect_timeout_s: float = 5.0

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            *_message_size_options(self.max_message_bytes),
            ("grpc.keepalive_time_ms", self.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", self.max_reconnect_backoff_ms),
        ]
