"""Exceptions of the control plane.

Every error a caller can act on has its own class; the message says what was wrong and,
where it helps, what to change. Bad input raises :class:`InvalidInput` (a ``ValueError``
declared in the leaf package ``protocol/``, so every layer raises the same one), never an
``AssertionError``.
"""

from __future__ import annotations

from typing import Any

from protocol.declare import check_fields
from protocol.errors import InvalidInput

__all__ = [
    "BackendUnavailable", "ConfigError", "ControlPlaneError", "InvalidInput", "NotConnected",
    "PayloadTooLarge", "check_options",
]  # fmt: skip


class ControlPlaneError(Exception):
    """Base class of every exception raised by ``runtime/``."""


class ConfigError(ControlPlaneError, ValueError):
    """A backend URL or an option is malformed or out of range."""


class PayloadTooLarge(InvalidInput):
    """An encoded message exceeds the size limit of the interface it was sent to."""


class BackendUnavailable(ControlPlaneError):
    """The backing service (etcd, NATS, the state directory) could not be reached in time."""


class NotConnected(ControlPlaneError):
    """An operation was attempted before ``connect()`` or after ``close()``."""


def check_options(options: Any) -> None:
    """Check an options dataclass against its fields' declarations
    (`protocol.declare.spec`); what is out of range is a ConfigError."""
    try:
        check_fields(options)
    except InvalidInput as e:
        raise ConfigError(str(e)) from None
