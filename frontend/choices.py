"""``n`` choices of one request as one stream of ``(index, Delta)``.

Choice 0 goes first. Once its first output arrives, its prompt's KV is computed and
in the prefix cache of the decode worker that holds it, and the other choices are sent
to that same worker: each finds the prompt's full blocks there (shared, reference
counted) and computes only the last partial block and its own tokens, so ``n``
choices hold the prompt once plus a block each, not ``n`` times. A seeded request's
choice ``i`` samples with seed ``seed + i``, so choices differ and the whole response
is reproducible. With ``n == 1`` this is a thin pass-through.

Usage counts the prompt once and the completion tokens of every choice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable

from frontend.generation import Delta, Generation
from runtime.rpc import Usage

# (choice index, the worker to prefer or None) -> the choice's generation; the maker
# calls ``on_worker`` with the worker each attempt runs on.
MakeChoice = Callable[[int, str | None, Callable[[str], None]], Generation]


class Choices:
    def __init__(self, n: int, make: MakeChoice) -> None:
        self.n = n
        self._make = make
        self.generations: list[Generation] = []
        self._worker: str | None = None

    @property
    def usage(self) -> Usage:
        first = self.generations[0].usage
        completion = sum(g.num_tokens for g in self.generations)
        return Usage(first.prompt_tokens, completion, first.cached_tokens)

    def _on_worker(self, worker_id: str) -> None:
        self._worker = worker_id

    def _start(self, index: int, prefer: str | None) -> AsyncGenerator[Delta, None]:
        gen = self._make(index, prefer, self._on_worker if index == 0 else lambda _: None)
        self.generations.append(gen)
        return gen.deltas()

    async def deltas(self) -> AsyncGenerator[tuple[int, Delta], None]:
        """Every choice's deltas, interleaved as they come; each choice's last delta
        carries its finish reason. Raises what a choice raises (APIError)."""
        first_stream = self._start(0, None)
        if self.n == 1:
            async with contextlib.aclosing(first_stream):
                async for d in first_stream:
                    yield 0, d
            return
        streams = [first_stream]
        queue: asyncio.Queue[tuple[int, Delta | BaseException]] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []

        async def pump(i: int, stream: AsyncGenerator[Delta, None]) -> None:
            try:
                async for d in stream:
                    await queue.put((i, d))
            except Exception as e:  # handed to the reader, which raises it
                await queue.put((i, e))

        try:
            first = await anext(first_stream)
            yield 0, first
            worker = self._worker
            streams += [self._start(i, worker) for i in range(1, self.n)]
            open_ = set(range(self.n))
            if first.finish_reason is not None:
                open_.discard(0)
            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams) if i in open_]
            while open_:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    open_.discard(i)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()
