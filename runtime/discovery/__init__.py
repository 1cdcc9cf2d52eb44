"""Worker discovery: etcd in production, a SQLite file on one host."""

from runtime.discovery.base import Discovery, DiscoveryOptions
from runtime.discovery.embedded import EmbeddedDiscovery
from runtime.discovery.etcd import EtcdDiscovery
from runtime.discovery.records import DiscoveryEvent, EventKind, role_prefix, worker_key
from runtime.discovery.registration import Registration

__all__ = [
    "Discovery",
    "DiscoveryEvent",
    "DiscoveryOptions",
    "EmbeddedDiscovery",
    "EtcdDiscovery",
    "EventKind",
    "Registration",
    "role_prefix",
    "worker_key",
]
