"""The deployment secret: one value shared by every process of one deployment
(``DIPTYCH_CLUSTER_SECRET``, or a file named by ``DIPTYCH_CLUSTER_SECRET_FILE``). The
control plane (`runtime/secret.py`) and the transfer layer (`transfer/auth.py`) each
derive their own keys from it."""

from __future__ import annotations

import functools
import os


@functools.cache
def deployment_secret() -> bytes | None:
    """The secret from the environment (read once), or None when none is set."""
    value = os.environ.get("DIPTYCH_CLUSTER_SECRET", "").encode()
    path = os.environ.get("DIPTYCH_CLUSTER_SECRET_FILE")
    if not value and path:
        with open(path, "rb") as f:
            value = f.read().strip()
    return value or None
