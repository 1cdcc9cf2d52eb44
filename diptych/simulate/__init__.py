"""`diptych simulate`: a discrete-event fleet simulator in virtual time.

No processes, no sockets, no sleeping: each simulated worker is a real `EngineCore`
(scheduler, KV cache manager, prefix cache, remote-KV wait state) on a virtual
simulated runner (`engine.sim`, `SimConfig(virtual=True)`), requests are routed by
the frontend's router, and time jumps from one event to the next. Between events a
worker whose batch only decodes advances many steps at once
(`diptych/simulate/fast_forward.py`), so an hour of a large fleet costs what its events
cost, not what its steps would.

    workload.py   a `diptych bench` workload, as token ids, with its arrival times
    worker.py     one simulated worker: its engine, the step or run in flight
    fleet.py      the event loop: arrivals, routing, prefill queue, KV transfer
    results.py    `vllm bench serve`-style metrics and the timeline
    cli.py        the command
"""
