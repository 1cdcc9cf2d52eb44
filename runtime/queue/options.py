"""Options, results and counters of the prefill queue."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from protocol.declare import check_name, spec
from runtime.errors import ConfigError, ControlPlaneError, check_options

# A 128k-token prompt encodes to ~400 KB; NATS's default max_payload is 1 MiB.
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024


class QueueFull(ControlPlaneError):
    """The queue holds ``max_pending`` requests: prefill locally instead of waiting."""


@dataclass(frozen=True)
class QueueOptions:
    namespace: str = "default"
    ack_wait: float = spec(
        10.0, lo=0.1, hi=3600,
        help="seconds before a dead consumer's message is redelivered; heartbeat at 1/3",
    )  # fmt: skip
    max_deliveries: int = spec(3, lo=1, hi=100, help="attempts of work before the dead letter")
    dedup_window: float = spec(
        120.0, lo=0.0, lo_open=True, help="seconds of publish-side dedup by request id"
    )
    done_ttl: float = 3600.0  # how long completion marks are kept (consumer-side dedup)
    retention: float = spec(
        3600.0, lo=0.0, lo_open=True, help="seconds before requests and dead letters are dropped"
    )
    max_pending: int = spec(
        10_000, lo=1, hi=10_000_000, help="messages beyond which publish fails with QueueFull"
    )
    max_message_bytes: int = spec(DEFAULT_MAX_MESSAGE_BYTES, lo=1024, hi=64 * 1024 * 1024)
    publish_timeout: float = spec(
        5.0, lo=0.0, lo_open=True, help="seconds, retries included, while the server is away"
    )
    op_timeout: float = spec(2.0, lo=0.0, lo_open=True, help="seconds of one round trip")
    poll_interval: float = spec(
        0.005, lo=0.0, lo_open=True, help="embedded backend: longest sleep between idle polls"
    )
    # seals every message written and refuses unsealed ones (runtime/queue/signing.py);
    # the key derived from the deployment secret, None without one
    signing_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        check_options(self)
        if self.done_ttl < self.ack_wait * (self.max_deliveries + 1):
            raise ConfigError("done_ttl must outlast every redelivery of a message")
        if self.signing_key is not None and len(self.signing_key) < 16:
            raise ConfigError("signing_key must have at least 16 bytes")


@dataclass(frozen=True)
class PublishResult:
    sequence: int
    duplicate: bool  # this request id was already in the queue; nothing was added


@dataclass(frozen=True)
class QueueDepth:
    pending: int  # waiting for a consumer (including nak'ed ones waiting out a delay)
    in_flight: int  # delivered, not yet acked


@dataclass
class QueueStats:
    """Counters of this client, for metrics and tests."""

    published: int = 0
    publish_duplicates: int = 0
    delivered: int = 0
    redelivered: int = 0
    acked: int = 0
    naked: int = 0
    dead_lettered: int = 0
    skipped_completed: int = 0  # redeliveries of already-completed requests, acked unseen
    malformed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)  # not ours: signing.REJECTIONS

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


def request_key(request_id: str) -> str:
    """A fixed-length token for a request id, safe in NATS subjects and SQL keys."""
    return hashlib.sha256(request_id.encode()).hexdigest()[:40]
