"""The Kubernetes connector: scale the prefill and decode Deployments through their
`scale` subresource, with the official `kubernetes` Python client.

    KubernetesConnector(namespace="llm", deployments={"prefill": "diptych-prefill",
                                                      "decode": "diptych-decode"})

Credentials: in a pod, its service account (`load_incluster_config`); elsewhere the
kubeconfig (`kubeconfig=` or $KUBECONFIG / ~/.kube/config). The namespace defaults
to the pod's own, then the kubeconfig context's, then "default".

Each `scale` reads the Deployment's scale (GET .../deployments/<name>/scale) and
patches it (PATCH, `{"spec": {"replicas": N}}`) only when it differs, so a steady
planner makes no writes. Graceful scale-down is Kubernetes': the pod gets SIGTERM,
the worker drains (leaves discovery, finishes what it holds) within the pod's
`terminationGracePeriodSeconds`, which the chart sets above `--drain-timeout`.

Hand edits are respected: when the replicas found differ from what this connector
last wrote, someone (`kubectl scale`, a GitOps sync) set them; the connector leaves
that Deployment alone for `manual_hold_s` (raising `HandEdited`, which the planner
logs once and exports as `diptych_planner_errors_total{kind="hand_edit"}`), then
resumes from the replicas it finds.

RBAC the planner's service account needs (and nothing more), in the workers'
namespace:

    - apiGroups: ["apps"]
      resources: ["deployments/scale"]
      verbs: ["get", "patch"]

Pools of multi-node workers are LeaderWorkerSets (`kinds={"decode": "LeaderWorkerSet"}`,
the chart's lws.enabled): the same two calls on their `scale` subresource (group
leaderworkerset.x-k8s.io, resource leaderworkersets/scale), one replica a whole group
of pods.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from runtime.errors import ConfigError

log = logging.getLogger(__name__)

IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


LWS_GROUP, LWS_VERSION, LWS_PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
KINDS = ("Deployment", "LeaderWorkerSet")


class HandEdited(RuntimeError):
    """The Deployment's replicas were set by someone else; left alone for now."""

    kind = "hand_edit"


def _client_and_namespace(kubeconfig: str | None) -> tuple[Any, str | None]:
    from kubernetes import client
    from kubernetes import config as kube_config

    config: Any = kube_config  # the loaders are untyped
    try:
        return _load(client, config, kubeconfig)
    except config.ConfigException as e:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise ConfigError(
            f"the kubernetes connector has no credentials: not in a pod, and no usable "
            f"kubeconfig at {where} ({e}); pass --kubeconfig"
        ) from None


def _load(client: Any, config: Any, kubeconfig: str | None) -> tuple[Any, str | None]:
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        try:
            with open(IN_CLUSTER_NAMESPACE) as f:
                return client.ApiClient(), f.read().strip()
        except OSError:
            return client.ApiClient(), None
    config.load_kube_config(config_file=kubeconfig)
    _, context = config.list_kube_config_contexts(config_file=kubeconfig)
    namespace = (context or {}).get("context", {}).get("namespace")
    return client.ApiClient(), namespace


class KubernetesConnector:
    name = "kubernetes"

    def __init__(
        self,
        namespace: str | None = None,
        deployments: Mapping[str, str] | None = None,
        kubeconfig: str | None = None,
        *,
        api_client: Any = None,
        manual_hold_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        kinds: Mapping[str, str] | None = None,
    ) -> None:
        """`api_client`: a configured `kubernetes.client.ApiClient` (tests, or a caller
        with its own credentials); otherwise one from the pod or the kubeconfig.
        `kinds`: what each pool is, "Deployment" (the default) or "LeaderWorkerSet"."""
        from kubernetes import client

        self.kinds = dict(kinds or {})
        for pool, kind in self.kinds.items():
            if kind not in KINDS:
                raise ConfigError(f"the {pool} pool must be one of {KINDS}, not {kind!r}")

        found_namespace = None
        if api_client is None:
            api_client, found_namespace = _client_and_namespace(kubeconfig)
        self.namespace = namespace or found_namespace or "default"
        self.deployments = dict(
            deployments or {"prefill": "diptych-prefill", "decode": "diptych-decode"}
        )
        self.apps = client.AppsV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._api_client = api_client
        self.manual_hold_s = manual_hold_s
        self._clock = clock
        self._written: dict[str, int] = {}  # pool -> replicas this connector last set
        self._held_until: dict[str, tuple[float, str]] = {}  # pool -> (until, why)

    async def current(self, pool: str) -> int | None:
        """The Deployment's replicas (its spec: pods running or starting)."""
        return await asyncio.to_thread(self._current, pool)

    def _current(self, pool: str) -> int | None:
        from kubernetes.client.exceptions import ApiException

        name = self.deployments.get(pool)
        if name is None:
            return 0
        kind = self.kinds.get(pool, "Deployment")
        try:
            return self._replicas(kind, name)
        except ApiException as e:
            raise RuntimeError(_api_error("read", kind, name, self.namespace, e)) from None

    async def scale(self, pool: str, replicas: int) -> None:
        await asyncio.to_thread(self._scale, pool, replicas)

    def _scale(self, pool: str, replicas: int) -> None:
        from kubernetes.client.exceptions import ApiException

        name = self.deployments.get(pool)
        if name is None:
            if replicas == 0:  # a pool this fleet does not have stays at none
                return
            raise ValueError(f"no Deployment configured for the {pool} pool")
        kind = self.kinds.get(pool, "Deployment")
        try:
            current = self._replicas(kind, name) or 0
        except ApiException as e:
            raise RuntimeError(_api_error("read", kind, name, self.namespace, e)) from None
        now = self._clock()
        held = self._held_until.get(pool)
        if held is not None:
            until, why = held
            if now < until:
                raise HandEdited(why)  # the same words: the planner logs it once
            del self._held_until[pool]
            self._written[pool] = current  # resume from what we find
        last = self._written.get(pool)
        if last is not None and current != last:
            why = (
                f"{name} was scaled to {current} by hand (the planner had set {last}); "
                f"left alone for {self.manual_hold_s:g} s"
            )
            self._held_until[pool] = (now + self.manual_hold_s, why)
            self._written.pop(pool)
            raise HandEdited(why)
        if current == replicas:
            self._written[pool] = current
            return
        try:
            self._patch(kind, name, replicas)
        except ApiException as e:
            raise RuntimeError(_api_error("scale", kind, name, self.namespace, e)) from None
        self._written[pool] = replicas
        log.info("kubernetes: %s/%s scaled %d -> %d", self.namespace, name, current, replicas)

    def _replicas(self, kind: str, name: str) -> int | None:
        """The workload's scale: its spec's replicas (None: unset)."""
        if kind == "Deployment":
            found = self.apps.read_namespaced_deployment_scale(name, self.namespace)
            return int(found.spec.replicas or 0) if found.spec is not None else None
        doc = self.custom.get_namespaced_custom_object_scale(
            LWS_GROUP, LWS_VERSION, self.namespace, LWS_PLURAL, name
        )
        spec = doc.get("spec") if isinstance(doc, dict) else None
        return int(spec.get("replicas") or 0) if isinstance(spec, dict) else None

    def _patch(self, kind: str, name: str, replicas: int) -> None:
        body = {"spec": {"replicas": replicas}}
        if kind == "Deployment":
            self.apps.patch_namespaced_deployment_scale(name, self.namespace, body)
        else:
            self.custom.patch_namespaced_custom_object_scale(
                LWS_GROUP, LWS_VERSION, self.namespace, LWS_PLURAL, name, body
            )

    async def close(self) -> None:
        await asyncio.to_thread(self._api_client.close)


def _api_error(what: str, kind: str, name: str, namespace: str, e: Any) -> str:
    resource = (
        "apps deployments/scale" if kind == "Deployment" else f"{LWS_GROUP} {LWS_PLURAL}/scale"
    )
    hint = {
        403: f"the planner's service account lacks get/patch on {resource}",
        404: f"no such {kind} (check --prefill-deployment/--decode-deployment and "
        "the namespace)",
    }.get(int(e.status or 0), "")
    text = f"cannot {what} {kind} {namespace}/{name}: HTTP {e.status} {e.reason}"
    return f"{text}; {hint}" if hint else text
