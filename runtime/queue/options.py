"""Options, results and counters of the prefill queue."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from runtime.errors import ConfigError, ControlPlaneError
from runtime.validation import check_name

# A 128k-token prompt encodes to ~400 KB; NATS's default max_payload is 1 MiB.
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024


class QueueFull(ControlPlaneError):
    """The queue holds ``max_pending`` requests: prefill locally instead of waiting."""


@dataclass(frozen=True)
class QueueOptions:
    namespace: str = "default"
    ack_wait: float = 10.0  # redelivery delay after a consumer dies; heartbeat at 1/3 of it
    max_deliveries: int = 3  # attempts of work before the dead letter
    dedup_window: float = 120.0  # publish-side duplicate detection by request id
    done_ttl: float = 3600.0  # how long completion marks are kept (consumer-side dedup)
    retention: float = 3600.0  # requests and dead letters older than this are dropped
    max_pending: int = 10_000  # publish fails with QueueFull beyond this many messages
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    publish_timeout: float = 5.0  # total, retries included, while the server is away
    op_timeout: float = 2.0  # one server round trip
    poll_interval: float = 0.005  # embedded backend: longest sleep between idle polls
    # seals every message written and refuses unsealed ones (runtime/queue/signing.py);
    # the key derived from the deployment secret, None without one
    signing_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_name("namespace", self.namespace)
        if not 0.1 <= self.ack_wait <= 3600:
            raise ConfigError(f"ack_wait must be in [0.1, 3600] seconds, got {self.ack_wait}")
        if not 1 <= self.max_deliveries <= 100:
            raise ConfigError(f"max_deliveries must be in [1, 100], got {self.max_deliveries}")
        if self.done_ttl < self.ack_wait * (self.max_deliveries + 1):
            raise ConfigError("done_ttl must outlast every redelivery of a message")
        for name in ("dedup_window", "retention", "publish_timeout", "op_timeout", "poll_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not 1 <= self.max_pending <= 10_000_000:
            raise ConfigError("max_pending must be in [1, 10_000_000]")
        if not 1024 <= self.max_message_bytes <= 64 * 1024 * 1024:
            raise ConfigError("max_message_bytes must be in [1 KiB, 64 MiB]")
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
