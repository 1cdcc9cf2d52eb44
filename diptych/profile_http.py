"""`diptych profile --url`: the same sweep, through a running server's OpenAI API.

Prompts go to /v1/completions as token ids (exact lengths, shared prefixes that the
server's prefix cache finds). A prefill point is one non-streamed request of
`max_tokens=1` (its latency is the client's TTFT); a decode point is `batch`
streamed requests of `context` prompt tokens whose per-token gaps (an event's gap
over the tokens its `logprobs` lists) are measured once the last of them started; a
mixed point sends one such prefill while `batch` streams run and takes the longest gap
they see while it runs, less their median gap before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import AsyncIterator

import httpx


class HttpProfiler:
    def __init__(self, url: str, vocab_size: int, seed: int = 0) -> None:
        self.url = url.rstrip("/")
        self.rng = random.Random(seed)
        self._vocab = range(min(64, vocab_size - 1), vocab_size)
        self.model = ""

    def _prompt(self, n: int) -> list[int]:
        return self.rng.choices(self._vocab, k=n)

    async def _body(self, prompt: list[int], max_tokens: int, stream: bool) -> dict[str, object]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": stream}  # fmt: skip
        if stream:
            # each event's tokens listed: the detokenizer holds back partial characters,
            # so one event may carry several
            body["logprobs"] = 0
        return body

    @contextlib.asynccontextmanager
    async def _client(self, connections: int = 4) -> AsyncIterator[httpx.AsyncClient]:
        """A client for `connections` streams; the served model's name learnt once."""
        limits = httpx.Limits(max_connections=connections)
        key = os.environ.get("OPENAI_API_KEY")  # a server started with --api-key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
            if not self.model:
                self.model = (await client.get(self.url + "/v1/models")).json()["data"][0]["id"]
            yield client

    async def _complete(self, client: httpx.AsyncClient, prompt: list[int]) -> float:
        started = time.perf_counter()
        r = await client.post(self.url + "/v1/completions", json=await self._body(prompt, 1, False))
        r.raise_for_status()
        return time.perf_counter() - started

    async def prefill_s(self, new: int, cached: int) -> float:
        async with self._client() as client:
            prefix = self._prompt(cached)
            if cached:
                await self._complete(client, prefix)
            return await self._complete(client, prefix + self._prompt(new))

    async def decode_s(self, batch: int, context: int, gaps_each: int = 12) -> float:
        started = [0]
        all_started, enough = asyncio.Event(), asyncio.Event()
        gaps: list[float] = []
        tokens = 4096  # more than any stream needs: they stop once enough gaps are in

        async def stream(client: httpx.AsyncClient) -> None:
            body = await self._body(self._prompt(context), tokens, True)
            last = None
            async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    choices = json.loads(line[5:])["choices"]
                    if not choices:
                        continue
                    n = len((choices[0].get("logprobs") or {}).get("tokens") or [None])
                    now = time.perf_counter()
                    if last is None:
                        started[0] += 1
                        if started[0] == batch:
                            all_started.set()
                    elif all_started.is_set():
                        gaps.extend([(now - last) / n] * n)
                        if len(gaps) >= batch * gaps_each:
                            enough.set()
                    last = now
                    if enough.is_set():
                        return  # closing the stream aborts the request

        async with self._client(batch + 4) as client:
            await asyncio.gather(*(stream(client) for _ in range(batch)))
        if not gaps:
            raise RuntimeError(f"decode {batch} x {context}: no token gaps measured")
        return statistics.median(gaps)

    async def mixed_s(self, new: int, batch: int, context: int = 128, steady: int = 6) -> float:
        events: list[list[float]] = [[] for _ in range(batch)]
        ready, done = asyncio.Event(), asyncio.Event()

        async def stream(i: int, client: httpx.AsyncClient) -> None:
            body = await self._body(self._prompt(context), 4096, True)
            async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    if not json.loads(line[5:])["choices"]:
                        continue
                    events[i].append(time.perf_counter())
                    if all(len(e) > steady for e in events):
                        ready.set()
                    if done.is_set():
                        return  # closing the stream aborts the request

        async with self._client(batch + 4) as client:
            tasks = [asyncio.create_task(stream(i, client)) for i in range(batch)]
            await ready.wait()
            t0 = time.perf_counter()
            await self._complete(client, self._prompt(new))
            t1 = time.perf_counter()
            while not all(e and e[-1] > t1 for e in events):
                await asyncio.sleep(0.005)
            done.set()
            await asyncio.gather(*tasks)
        before, during = [], []
        for e in events:
            gaps = [(b - a, b) for a, b in itertools.pairwise(e)]
            before += [g for g, end in gaps if end < t0][-steady:]
            during.append(max(g for g, end in gaps if end > t0))
        return max(statistics.median(during) - statistics.median(before), 0.0)
