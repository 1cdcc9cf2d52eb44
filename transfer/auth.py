"""Secrets, incarnations and the proofs peers exchange.

Each agent incarnation draws a fresh 256-bit secret and publishes it in its
metadata, so exactly the agents that were handed that metadata (through
discovery) can act as that agent. Secrets never cross a connection: a peer
proves it holds one with an HMAC over a transcript that both sides' random
nonces make unique, so a recorded handshake cannot be replayed.

With a deployment secret (``DIPTYCH_CLUSTER_SECRET``, or a file named by
``DIPTYCH_CLUSTER_SECRET_FILE``) every proof and notification signature is keyed by
HMAC(deployment secret, agent secret): metadata read out of discovery is then not
enough to act as an agent; the deployment secret is needed too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from protocol.secret import deployment_secret

SECRET_BYTES = 32
NONCE_BYTES = 16


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def new_incarnation() -> str:
    """128 random bits as 32 hex digits: unique per agent start."""
    return secrets.token_hex(16)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def transcript(
    transport: str,
    client: tuple[str, str],
    server: tuple[str, str],
    client_nonce: bytes,
    server_nonce: bytes,
) -> bytes:
    """Canonical bytes naming both ends (name, incarnation) and both nonces."""
    return json.dumps(
        [transport, list(client), list(server), client_nonce.hex(), server_nonce.hex()],
        separators=(",", ":"),
    ).encode()


def keyed(secret: bytes) -> bytes:
    """The key an agent secret signs with: mixed with the deployment secret, if any."""
    shared = deployment_secret()
    return secret if shared is None else hmac.new(shared, secret, hashlib.sha256).digest()


def prove(secret: bytes, role: str, message: bytes) -> bytes:
    return hmac.new(keyed(secret), role.encode() + b"\0" + message, hashlib.sha256).digest()


def verify(secret: bytes, role: str, message: bytes, proof: bytes) -> bool:
    return hmac.compare_digest(prove(secret, role, message), proof)
