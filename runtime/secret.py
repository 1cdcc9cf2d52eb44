"""The deployment secret, and the keys derived from it for each use.

A deployment secret (``DIPTYCH_CLUSTER_SECRET``, or a file named by
``DIPTYCH_CLUSTER_SECRET_FILE``) is shared by every process of one deployment. No
process uses it directly: each use takes its own key, ``HMAC(secret, purpose)``, so a
key that leaks from one use (a gRPC token seen on the wire) does not sign for another
(queue messages). The secret itself is read in one place, `protocol/secret.py`, which the
transfer layer's keys (``transfer/auth.py``) start from too.
"""

from __future__ import annotations

import hashlib
import hmac

from protocol.secret import deployment_secret

PURPOSES = ("diptych request plane", "diptych prefill queue", "diptych worker answer")


def derived_key(purpose: str) -> bytes | None:
    """The key of one use of the secret; None without a secret."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown purpose {purpose!r}; one of {PURPOSES}")
    secret = deployment_secret()
    return None if secret is None else hmac.new(secret, purpose.encode(), hashlib.sha256).digest()
