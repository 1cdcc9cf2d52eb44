"""The `diptych planner` process: scrape, plan, scale, and serve the dashboard.

    PlannerProcess(PlannerConfig(frontend_urls=("http://127.0.0.1:8000",),
                                 connector="local", connector_options={"url": ...}))

It wires the planner's pieces to the world: discovery (to find every worker's
metrics), the frontends' `/metrics`, a connector (local, kubernetes, ray, or none),
and an HTTP server for `/dashboard`, `/api/state` and `/metrics`. The SLA policy
sizes pools from a worker profile. Without one the planner says so (log line,
`diptych_planner_errors_total{kind="profile"}`, the dashboard's log) and plans with the
load policy, which needs none; a profile that is named but cannot be read stops it
before anything starts (a typo must not quietly switch the policy).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from planner.capacity import CapacityModel, PoolCapacity
from planner.config import PlannerConfig
from planner.connectors import Connector
from planner.core import Planner
from planner.dashboard import app as dashboard_app
from planner.observation import Slo
from planner.service import PlannerService
from planner.source import MetricsSource
from runtime.asgi_server import AsgiServer
from runtime.config import make_discovery
from runtime.discovery import Discovery, DiscoveryOptions
from runtime.errors import ConfigError

log = logging.getLogger(__name__)


def capacity_from_profile(
    profile: str, max_batch: int, kv_tokens: int | None, sizes: dict[str, int] | None = None
) -> CapacityModel:
    """A worker's capacity from a timing profile, as `--engine sim --profile` reads it;
    with `sizes` (each pool's tensor-parallel size) a roofline is taken at each pool's
    size (`at_tensor_parallel`), so prefill and decode workers of different sizes are
    each priced as they run."""
    from diptych.simulate.planning import capacity_of
    from engine.sim.timing import at_tensor_parallel, load_timing

    if sizes is None:
        return capacity_of(load_timing(profile), max_batch, kv_tokens)
    prefill, decode = (at_tensor_parallel(profile, sizes[pool]) for pool in ("prefill", "decode"))
    decode_model = capacity_of(load_timing(decode), max_batch, kv_tokens)
    if prefill == decode:
        return decode_model
    return PoolCapacity(capacity_of(load_timing(prefill), max_batch, kv_tokens), decode_model)


def check_profile(
    profile: str,
    max_batch: int = 128,
    kv_tokens: int | None = None,
    sizes: dict[str, int] | None = None,
) -> CapacityModel:
    """The capacity a named profile gives, or a ConfigError naming the profile."""
    try:
        return capacity_from_profile(profile, max_batch, kv_tokens, sizes)
    except Exception as e:
        raise ConfigError(f"the planner's profile {profile!r} is unusable: {e}") from None


def make_connector(config: PlannerConfig) -> Connector | None:
    """The connector the config names; a missing client library says what to install."""
    try:
        return _connector(config)
    except ModuleNotFoundError as e:
        extra = {"kubernetes": "kubernetes", "ray": "ray"}.get(config.connector, "")
        hint = f"; install it: pip install 'diptych[{extra}]'" if extra else ""
        raise RuntimeError(f"the {config.connector} connector needs {e.name}{hint}") from None


def _connector(config: PlannerConfig) -> Connector | None:
    opts = dict(config.connector_options)
    if config.connector == "none":
        return None
    if config.connector == "local":
        from planner.connectors.local import LocalConnector

        return LocalConnector(**opts)
    if config.connector == "kubernetes":
        from planner.connectors.kubernetes import KubernetesConnector

        return KubernetesConnector(**opts)
    from planner.connectors.ray import RayConnector

    return RayConnector(**opts)


class PlannerProcess:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self.service: PlannerService | None = None
        self.connector: Connector | None = None
        self._discovery: Discovery | None = None
        self._source: MetricsSource | None = None
        self._http: AsgiServer | None = None
        self._task: asyncio.Task[None] | None = None

    def _plan(self) -> tuple[Planner, str | None]:
        """The planner, and why it is not the one asked for (None when it is). A profile
        that is named but unreadable is a ConfigError: a typo must not quietly switch
        the policy."""
        cfg, plan = self.config, self.config.plan
        if plan.policy != "sla":
            return plan.planner(None), None
        if not cfg.profile:
            why = (
                "the SLA policy needs a worker profile (a `diptych profile` JSON: `serve "
                "--planner-profile`, `planner --profile`); planning by load"
            )
            return dataclasses.replace(plan, policy="load").planner(None), why
        capacity = check_profile(cfg.profile, cfg.max_batch, cfg.kv_tokens, plan.accelerators())
        return plan.planner(capacity), None

    def settings(self) -> dict[str, object]:
        """What the dashboard shows of the set-up."""
        doc = dataclasses.asdict(self.config.plan)
        assert self.service is not None
        doc["policy"] = self.service.planner.policy.name
        doc["time_scale"] = self.config.time_scale
        doc["profile"] = self.config.profile
        return doc

    async def start(self) -> dict[str, str]:
        cfg = self.config
        planner, fallback = self._plan()
        self._discovery = make_discovery(
            cfg.discovery_url, DiscoveryOptions(namespace=cfg.namespace)
        )
        await self._discovery.connect()
        self._source = MetricsSource(self._discovery, cfg.frontend_urls, cfg.scrape_timeout_s)
        self.connector = make_connector(cfg)
        self.service = PlannerService(
            planner,
            self._source,
            self.connector,
            interval_s=cfg.plan.interval_s,
            time_scale=cfg.time_scale,
            slo=Slo(cfg.plan.ttft_slo_s, cfg.plan.itl_slo_s),
        )
        if fallback is not None:
            self.service.failed("profile", "", fallback)
        self._http = AsgiServer(
            dashboard_app(self.service, self.settings()),
            cfg.host,
            cfg.port,
            name="planner",
            log_level="warning",
        )
        address = await self._http.start()
        self._task = asyncio.create_task(self.service.run(), name="planner")
        url = f"http://{address}"
        log.info("planner dashboard at %s/dashboard", url)
        policy = self.service.planner.policy.name
        return {"url": url, "dashboard": f"{url}/dashboard", "policy": policy}

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            await self._http.stop()
        for closer in (self.connector, self._source, self._discovery):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer.close()
