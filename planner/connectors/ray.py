"""The Ray connector: workers as Ray actors on a Ray cluster.

    RayConnector(address="auto", worker_args="--engine sim --etcd 10.0.0.2:2379",
                 actor_options={"num_gpus": 1})

Each worker is a named, detached actor `diptych-<pool>-<n>` (the actor class,
`diptych.ray_worker:WorkerActor` unless given, runs a decode or prefill worker with
`worker_args`, the flags of `diptych decode|prefill`) in the Ray namespace
`namespace`. Detached and named, the fleet outlives the planner: a restarted planner
adopts the actors it finds by name instead of starting a second fleet.

`scale` never blocks a tick on a worker's start-up: it creates actors and asks them
to start (the worker registers in discovery once it serves, which is when the
planner counts it ready), and for a scale-down asks the newest ones to stop (they
drain: leave discovery, finish what they hold) and kills each actor once its stop
returns. A start that failed is reported by the next `scale` (the planner logs it and
counts `diptych_planner_errors_total{kind="scale"}`), and the actor is replaced.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import shlex
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_ACTOR = "diptych.ray_worker:WorkerActor"


def _actor_class(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class RayConnector:
    name = "ray"

    def __init__(
        self,
        address: str | None = "auto",
        worker_args: str | list[str] = "",
        *,
        actor: str = DEFAULT_ACTOR,
        actor_options: Mapping[str, Any] | None = None,
        namespace: str = "diptych",
        init_options: Mapping[str, Any] | None = None,
    ) -> None:
        """`address`: the Ray cluster to join ("auto": the local node's; None: the
        Ray already initialised in this process). `actor_options`: resources and
        scheduling of each worker actor (num_gpus, num_cpus, resources, ...)."""
        if importlib.util.find_spec("ray") is None:
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        self.address = address
        self.flags = shlex.split(worker_args) if isinstance(worker_args, str) else worker_args
        self.actor_path = actor
        self.actor_options = dict(actor_options or {})
        self.namespace = namespace
        self.init_options = dict(init_options or {})
        self._ray: Any = None
        self._cls: Any = None  # the actor class, made remote once connected
        self._actors: dict[str, dict[str, Any]] = {}  # pool -> name -> handle
        self._starting: dict[str, Any] = {}  # name -> ObjectRef of its start()
        self._stopping: dict[str, tuple[Any, Any]] = {}  # name -> (handle, ref of stop())
        self._next: dict[str, int] = {}

    # -- connecting and adopting ------------------------------------------------------
    def _connect(self) -> Any:
        if self._ray is not None:
            return self._ray
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, namespace=self.namespace,
                     ignore_reinit_error=True, **self.init_options)  # fmt: skip
        self._ray = ray
        self._cls = ray.remote(_actor_class(self.actor_path))
        self._adopt()
        return ray

    def _adopt(self) -> None:
        """Take over the workers a previous planner left running."""
        ray = self._ray
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") != self.namespace:
                continue
            name = str(entry.get("name", ""))
            pool, _, index = name.removeprefix("diptych-").rpartition("-")
            if not name.startswith("diptych-") or not index.isdigit():
                continue
            handle = ray.get_actor(name, namespace=self.namespace)
            self._actors.setdefault(pool, {})[name] = handle
            self._next[pool] = max(self._next.get(pool, 0), int(index) + 1)
            log.info("ray: adopted %s", name)

    # -- scaling -----------------------------------------------------------------------
    async def current(self, pool: str) -> int | None:
        """The pool's actors, running or starting (adopted ones included)."""

        def count() -> int:
            self._connect()
            return len(self._actors.get(pool, {}))

        return await asyncio.to_thread(count)

    async def scale(self, pool: str, replicas: int) -> None:
        await asyncio.to_thread(self._scale, pool, replicas)

    def _scale(self, pool: str, replicas: int) -> None:
        if pool not in ("prefill", "decode"):
            raise ValueError(f"unknown pool {pool!r}")
        self._connect()
        failed = self._reap()
        live = self._actors.setdefault(pool, {})
        while len(live) < replicas:
            index = self._next.get(pool, 0)
            self._next[pool] = index + 1
            name = f"diptych-{pool}-{index}"
            handle = self._cls.options(
                name=name, namespace=self.namespace, lifetime="detached",
                max_concurrency=4,  # stop() must run while start() waits
                **self.actor_options,
            ).remote(pool, f"{pool}-{index}", self.flags)  # fmt: skip
            live[name] = handle
            self._starting[name] = handle.start.remote()
            log.info("ray: starting %s", name)
        # the newest go first
        for name in sorted(live, key=_index, reverse=True)[: max(0, len(live) - replicas)]:
            handle = live.pop(name)
            self._starting.pop(name, None)
            self._stopping[name] = (handle, handle.stop.remote())
            log.info("ray: draining %s", name)
        if failed:
            raise RuntimeError("; ".join(failed))

    def _reap(self) -> list[str]:
        """Kill the actors whose stop returned; drop (and report) failed starts."""
        ray = self._ray
        failed = []
        for name, ref in list(self._starting.items()):
            done, _ = ray.wait([ref], timeout=0)
            if not done:
                continue
            del self._starting[name]
            try:
                ray.get(ref)
            except Exception as e:
                failed.append(f"{name} failed to start: {e}")
                pool = name.removeprefix("diptych-").rpartition("-")[0]
                handle = self._actors.get(pool, {}).pop(name, None)
                if handle is not None:
                    ray.kill(handle)
        for name, (handle, ref) in list(self._stopping.items()):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                del self._stopping[name]
                ray.kill(handle)
                log.info("ray: %s drained and stopped", name)
        return failed

    def members(self) -> dict[str, list[str]]:
        """The actors this connector runs (not those draining), per pool."""
        return {pool: sorted(names, key=_index) for pool, names in self._actors.items()}

    def draining(self) -> list[str]:
        self._reap()
        return sorted(self._stopping)

    async def close(self) -> None:
        """Forget the actors (they keep serving: the fleet outlives the planner)."""
        self._actors.clear()


def _index(name: str) -> int:
    tail = name.rpartition("-")[2]
    return int(tail) if tail.isdigit() else -1
