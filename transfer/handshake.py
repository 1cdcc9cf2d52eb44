"""Mutual authentication of a control connection.

::

    client                                         server
    HELLO {transport, name, incarnation,
           to, to_incarnation, nonce_c}   ----->   is `name` a peer we added, with
                                                   that incarnation? are we `to`?
                                          <-----   CHALLENGE {nonce_s, proof_s}   or REJECT
    check proof_s with the server's secret
    PROOF {proof_c}                       ----->   check proof_c with the client's secret
                                          <-----   WELCOME                        or REJECT

Proofs are HMACs over the transcript (transport, both names and incarnations,
both nonces) with the prover's own secret, which the verifier knows from the
metadata it was given. A REJECT carries a reason:

* ``unknown-peer``: the server never added the client (counted, see `Stats`);
* ``stale-peer``: the server added another incarnation of the client;
* ``wrong-incarnation``: the client's metadata of the server is out of date
  (the server restarted) and the client raises `PeerRestartedError`;
* ``auth``: the client's proof did not verify.
"""

from __future__ import annotations

import contextlib
from typing import Any, NoReturn

from transfer import auth
from transfer.context import AgentContext, Peer
from transfer.errors import (
    AuthenticationError,
    PeerRejectedError,
    PeerRestartedError,
    ProtocolError,
)
from transfer.link import Frame, FramedSocket, Kind, encode


class Rejected(Exception):
    """Raised on the server after it sent REJECT; the connection must close."""


def client(fs: FramedSocket, ctx: AgentContext, peer: Peer, transport: str) -> None:
    nonce_c = auth.new_nonce()
    fs.send(
        encode(
            Kind.HELLO,
            info={
                "transport": transport,
                "name": ctx.name,
                "incarnation": ctx.incarnation,
                "to": peer.name,
                "to_incarnation": peer.incarnation,
                "nonce": nonce_c.hex(),
            },
        )
    )
    f = _expect(fs.recv_frame(), Kind.CHALLENGE, peer)
    nonce_s, proof_s = _hex(f.info, "nonce"), _hex(f.info, "proof")
    t = auth.transcript(
        transport, (ctx.name, ctx.incarnation), (peer.name, peer.incarnation), nonce_c, nonce_s
    )
    if not auth.verify(peer.md.secret, "server", t, proof_s):
        raise AuthenticationError(peer.name, "could not prove it holds the secret of its metadata")
    fs.send(encode(Kind.PROOF, info={"proof": auth.prove(ctx.secret, "client", t).hex()}))
    _expect(fs.recv_frame(), Kind.WELCOME, peer)


def server(fs: FramedSocket, ctx: AgentContext, transport: str) -> Peer:
    """Authenticate the connecting peer; raises `Rejected` after sending REJECT."""
    hello = fs.recv_frame()
    if hello.kind != Kind.HELLO:
        raise ProtocolError(f"expected HELLO, got {hello.kind.name}")
    info = hello.info
    name, inc = _str(info, "name"), _str(info, "incarnation")
    if _str(info, "transport") != transport:
        _reject(fs, ctx, "rejected_malformed", "wrong-transport", f"this is a {transport} endpoint")
    if _str(info, "to") != ctx.name or _str(info, "to_incarnation") != ctx.incarnation:
        _reject(
            fs, ctx, "rejected_stale_peer", "wrong-incarnation", f"{ctx.name} is {ctx.incarnation}"
        )
    peer = ctx.peers.lookup(name)
    if peer is None:
        _reject(
            fs, ctx, "rejected_unknown_peer", "unknown-peer", f"{ctx.name} never added {name!r}"
        )
    if peer.incarnation != inc:
        _reject(
            fs, ctx, "rejected_stale_peer", "stale-peer", f"{ctx.name} knows another incarnation"
        )
    nonce_c, nonce_s = _hex(info, "nonce"), auth.new_nonce()
    t = auth.transcript(transport, (name, inc), (ctx.name, ctx.incarnation), nonce_c, nonce_s)
    proof_s = auth.prove(ctx.secret, "server", t)
    fs.send(encode(Kind.CHALLENGE, info={"nonce": nonce_s.hex(), "proof": proof_s.hex()}))
    f = fs.recv_frame()
    if f.kind != Kind.PROOF or not auth.verify(peer.md.secret, "client", t, _hex(f.info, "proof")):
        _reject(fs, ctx, "rejected_auth", "auth", "proof did not verify")
    fs.send(encode(Kind.WELCOME))
    return peer


def _reject(
    fs: FramedSocket, ctx: AgentContext, counter: str, reason: str, detail: str
) -> NoReturn:
    ctx.stats.inc(counter)
    with contextlib.suppress(OSError):
        fs.send(encode(Kind.REJECT, info={"reason": reason, "detail": detail}))
    raise Rejected(reason)


def _expect(f: Frame, kind: Kind, peer: Peer) -> Frame:
    if f.kind == Kind.REJECT:
        reason, detail = str(f.info.get("reason", "?")), str(f.info.get("detail", ""))
        if reason == "wrong-incarnation":
            raise PeerRestartedError(peer.name, f"it restarted; refresh its metadata ({detail})")
        raise PeerRejectedError(peer.name, reason, detail)
    if f.kind != kind:
        raise ProtocolError(f"expected {kind.name}, got {f.kind.name}")
    return f


def _str(info: dict[str, Any], key: str) -> str:
    v = info.get(key)
    if not isinstance(v, str):
        raise ProtocolError(f"handshake field {key!r} missing")
    return v


def _hex(info: dict[str, Any], key: str) -> bytes:
    try:
        return bytes.fromhex(_str(info, key))
    except ValueError:
        raise ProtocolError(f"handshake field {key!r} is not hex") from None
