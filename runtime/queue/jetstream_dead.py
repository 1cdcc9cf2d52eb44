"""Reading one decode worker's dead letters from JetStream."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import api

from runtime.errors import BackendUnavailable, NotConnected
from runtime.queue.jetstream import TRANSIENT_ERRORS, JetStreamPrefillQueue
from runtime.queue.messages import DeadLetter

log = logging.getLogger(__name__)


async def read_dead_letters(q: JetStreamPrefillQueue, worker: str) -> AsyncIterator[DeadLetter]:
    """Letters for ``worker`` published from now on, through an ephemeral consumer that is
    recreated from the last sequence seen after every reconnect (a restarted server may
    have dropped it)."""
    js = q._require_js()
    subject = q._dead_prefix + worker
    info = await q._retry(lambda: js.stream_info(q._dead_stream))
    next_seq = info.state.last_seq + 1  # deliver only letters published from now on
    first = True
    while q._nc is not None:
        if not first:
            try:
                info = await q._retry(lambda: js.stream_info(q._dead_stream))
            except BackendUnavailable as e:
                log.warning("dead-letter stream unreachable for %s (%s); retrying", worker, e)
                continue
            except NotConnected:
                return
            if info.state.last_seq + 1 < next_seq:  # the server lost its data: start over
                next_seq = max(1, info.state.first_seq)
        first = False
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=next_seq,
            ack_policy=api.AckPolicy.NONE, inactive_threshold=60.0, filter_subject=subject,
        )  # fmt: skip
        try:
            subscribe = functools.partial(
                js.pull_subscribe, subject, stream=q._dead_stream, config=config
            )
            sub = await q._retry(subscribe)
        except BackendUnavailable as e:
            log.warning("dead-letter subscription for %s failed (%s); retrying", worker, e)
            continue
        except NotConnected:
            return
        seen_reconnects = q._reconnects
        try:
            while seen_reconnects == q._reconnects:
                try:
                    msgs = await sub.fetch(64, timeout=1.0)
                except (nats.errors.TimeoutError, asyncio.TimeoutError):
                    continue
                for m in msgs:
                    next_seq = m.metadata.sequence.stream + 1
                    letter = q._open_dead_letter(m.data)
                    if letter is not None:
                        yield letter
        except nats.errors.ConnectionClosedError:
            return  # the queue was closed
        except (*TRANSIENT_ERRORS, nats.js.errors.APIError) as e:
            log.warning("dead-letter consumer for %s failed (%r); recreating", worker, e)
            await asyncio.sleep(0.25)
        finally:
            await _drop_consumer(js, q._dead_stream, sub)
        # After a reconnect the ephemeral consumer may be gone: recreate from next_seq.


async def _drop_consumer(js: Any, stream: str, sub: Any) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(js.delete_consumer(stream, sub._consumer), 1.0)
