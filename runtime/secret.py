"""The deployment secret, and the keys derived from it for each use.

A deployment secret (``DIPTYCH_CLUSTER_SECRET``, or a file named by
``DIPTYCH_CLUSTER_SECRET_FILE``) is shared by every process of one deployment. No
process uses it directly: each use takes its own key, ``HMAC(secret, purpose)``, so a
key that leaks from one use (a gRPC token seen on the wire) does not sign for another
(queue messages). The transfer layer reads the same variables (``transfer/auth.py``;
it imports nothing internal).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os

PURPOSES = ("diptych request plane", "diptych prefill queue", "diptych worker answer")


@functools.cache
def deployment_secret() -> bytes | None:
    """The secret from the environment (read once), or None when none is set."""
    value = os.environ.get("DIPTYCH_CLUSTER_SECRET", "").encode()
    path = os.environ.get("DIPTYCH_CLUSTER_SECRET_FILE")
    if not value and path:
        with open(path, "rb") as f:
            value = f.read().strip()
    return value or None


def derived_key(purpose: str) -> bytes | None:
    """The key of one use of the secret; None without a secret."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown purpose {purpose!r}; one of {PURPOSES}")
    secret = deployment_secret()
    return None if secret is None else hmac.new(secret, purpose.encode(), hashlib.sha256).digest()
