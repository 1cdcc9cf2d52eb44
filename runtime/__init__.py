"""Diptych's control plane: discovery, the prefill queue, the request plane, metrics.

Nothing here is role-specific, and nothing internal is imported. Import what you need
from its module; nothing is re-exported here, so ``import runtime.config`` does not pull
in gRPC, NATS and etcd clients.

* discovery (``runtime.discovery``): ``make_discovery`` -> ``Discovery`` (``register``,
  ``list``, ``watch``); records are ``runtime.worker_info.WorkerInfo``.
* prefill queue (``runtime.queue``): ``PrefillQueue`` (``publish``, ``fetch`` ->
  ``Delivery``, ``dead_letters``); messages are ``RemotePrefillRequest`` and ``DeadLetter``;
  the notice that ends a remote prefill is ``PrefillNotice``, in the same module.
* request plane (``runtime.rpc``): ``GenerateHandler`` served by ``DecodeWorkerServer``,
  used through ``DecodeWorkerClient``; ``KvEventPublisher`` feeds the Events stream.
* ``runtime.config.open_control_plane`` opens discovery and the queue from two URLs.
"""
