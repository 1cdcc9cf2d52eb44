"""What other threads ask of the engine thread: one typed command each.

The engine thread owns the `EngineCore`; an event loop never calls it, it sends one of
these (`AsyncEngine` queues them) and the engine thread applies them between steps, in
order (`apply`). What a command returns reaches the sender's future:

    Submit        admit a request (EngineCore.submit)        -> Admitted
    Abort         stop a request, free its blocks            -> None (unknown ids ignored)
    RemoteReady   adopt a remote prefill's KV + first token  -> the first token's output
    RemoteFailed  no remote write can land: prefill here     -> None
    ReleaseHeld   free a finished hold_blocks request        -> None
    BlockIds      a tracked or held request's block table    -> list[int]
    Inspect       a read of the core, for tests and tools    -> what it returns

Reads the other way (load, KV usage, what the prefix cache would give a prompt) go
through `EngineSnapshot`, which the engine thread publishes after every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.request import NewRequest, RemotePlan, RemoteRule, RequestOutput
from protocol.logprobs import TokenLogprob

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.grammar import GrammarState


@dataclass(frozen=True)
class Submit:
    new: NewRequest
    # prefill remotely when this rule says so (EngineCore.submit's remote_min_uncached)
    remote_rule: int | RemoteRule | None = None
    grammar: GrammarState | None = None  # compiled off the engine thread


@dataclass(frozen=True)
class Admitted:
    plan: RemotePlan | None  # blocks pinned for a remote prefill, or None: prefilled here
    cached_tokens: int  # of the prompt, held by the prefix cache at admission


@dataclass(frozen=True)
class _OneRequest:
    request_id: str


class Abort(_OneRequest):
    """Stop the request and free its blocks (an unknown id is ignored)."""


@dataclass(frozen=True)
class RemoteReady:
    request_id: str
    first_token: int
    logprob: TokenLogprob | None = None


class RemoteFailed(_OneRequest):
    """No remote write can land for the request: it prefills here."""


class ReleaseHeld(_OneRequest):
    """Free a finished `hold_blocks` request's blocks."""


class BlockIds(_OneRequest):
    """A tracked or held request's block table."""


@dataclass(frozen=True)
class Inspect:
    """A read of the core's state between steps (tests, diagnostics); it must not
    change the core."""

    read: Callable[[EngineCore], object]


EngineCommand = Submit | Abort | RemoteReady | RemoteFailed | ReleaseHeld | BlockIds | Inspect


def apply(core: EngineCore, command: EngineCommand) -> object:
    """Carry out one command on the engine thread; raises what the core raises (bad
    input: ValueError) for the sender."""
    match command:
        case Submit(new, rule, grammar):
            plan = core.submit(new, remote_min_uncached=rule, grammar=grammar)
            rid = new.request_id
            cached = core.prefix_hit_tokens(rid) if plan is None else plan.num_cached_tokens
            return Admitted(plan, cached)
        case Abort(rid):
            with contextlib.suppress(KeyError):  # finished or never admitted
                core.abort_request(rid)
            return None
        case RemoteReady(rid, token, logprob):
            out: RequestOutput = core.remote_kv_ready(rid, token, logprob)
            return out
        case RemoteFailed(rid):
            core.remote_kv_failed(rid)
            return None
        case ReleaseHeld(rid):
            core.release_held(rid)
            return None
        case BlockIds(rid):
            return core.block_ids(rid)
        case Inspect(read):
            return read(core)
    raise TypeError(f"not an engine command: {command!r}")
