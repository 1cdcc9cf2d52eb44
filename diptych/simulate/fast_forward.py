"""Many decode steps at once, for the fleet simulator: while nothing waits and every
running request only decodes, `advance_decodes` applies what `decode_room` rounds of
schedule -> forward -> update would, in one go (the simulator's timing model prices
the run; its tokens are the simulated model's). Engine code, used only here: the
scheduler itself knows nothing of virtual time.
"""

from __future__ import annotations

from engine.request import Request
from engine.scheduler import Scheduler


def decode_room(s: Scheduler) -> int:
    """How many decode steps every running request can take, all at once, before
    one might stop or the pool runs short of blocks; 0 when the next step must go
    through `schedule` (something waits, a request is mid-prefill, the pool is tight).
    """
    if s.waiting or not s.running:
        return 0
    if any(r.num_tokens - r.num_computed_tokens != 1 for r in s.running):
        return 0
    room = min(r.max_tokens - r.num_output_tokens for r in s.running)
    # a thinking budget's end is forced step by step (engine/reasoning.py): a run stops
    # short of it
    budgeted = [r.thinking_left for r in s.running
                if r.reasoning is not None and r.reasoning.budget is not None
                and not r.reasoning.answering]  # fmt: skip
    room = min([room, *budgeted])
    room = min(room, s.max_model_len - max(r.num_tokens for r in s.running))
    # each request needs at most ceil(steps / block_size) + 1 new blocks
    per_request = s.kv.pool.num_free // len(s.running) - 1
    return max(0, min(room, per_request * s.kv.block_size))


def advance_decodes(s: Scheduler, steps: int, tokens: dict[str, list[int]]) -> list[Request]:
    """`steps` decode steps of every running request at once: what `steps` rounds
    of schedule -> forward -> update would do, as the fleet simulator keeps virtual time.

    Valid only for `steps <= decode_room()`. `tokens[request_id]` is the `steps`
    tokens the request samples. Returns the requests that finished.
    """
    if not 0 < steps <= decode_room(s):
        raise ValueError(f"cannot advance {steps} steps; room for {decode_room(s)}")
    finished: list[Request] = []
    for req in s.running:
        if not s.kv.allocate_slots(req, steps):
            raise RuntimeError(f"no KV room for {req.request_id}")  # decode_room says
        new = tokens[req.request_id]
        req.all_token_ids.extend(new[:-1])
        req.output_token_ids.extend(new[:-1])
        if req.reasoning is not None:  # the thinking count goes on through the run
            for token in new[:-1]:
                req.reasoning.accept(token)
        req.num_computed_tokens += steps
        s.kv.cache_blocks(req, req.num_computed_tokens)
        s.record_sampled(req, new[-1], finished)
    if finished:
        s.running = [r for r in s.running if not r.finished]
    return finished
