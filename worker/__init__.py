"""The worker runtime both roles compose: transfer agent, KV pool, engine, control plane,
peers, metrics and registration (`assembly.WorkerRuntime`), and the one converter module
between the engine's types and the control plane's wire types (`convert`).

Imports `engine/`, `transfer/` and `runtime/`; only `decode_worker/` and `prefill_worker/`
import it.
"""
