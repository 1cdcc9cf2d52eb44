"""The durable prefill queue: NATS JetStream in production, a SQLite file on one host."""

from runtime.queue.base import Delivery, PrefillQueue
from runtime.queue.embedded import EmbeddedPrefillQueue
from runtime.queue.jetstream import JetStreamPrefillQueue
from runtime.queue.messages import DeadLetter, DeadLetterReason, RemotePrefillRequest
from runtime.queue.options import PublishResult, QueueDepth, QueueFull, QueueOptions, QueueStats

__all__ = [
    "DeadLetter",
    "DeadLetterReason",
    "Delivery",
    "EmbeddedPrefillQueue",
    "JetStreamPrefillQueue",
    "PrefillQueue",
    "PublishResult",
    "QueueDepth",
    "QueueFull",
    "QueueOptions",
    "QueueStats",
    "RemotePrefillRequest",
]
