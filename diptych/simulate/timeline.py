"""A PNG of one simulated run over time: load, queues, KV usage and output tokens/s."""

from __future__ import annotations

from pathlib import Path

from diptych.simulate.results import Recorder


def plot_timeline(recorder: Recorder, path: str | Path, title: str = "") -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'matplotlib>=3.8'") from None
    rows = recorder.timeline
    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True)
    ax = axes[0]
    ax.plot(t, [r["in_flight"] for r in rows], label="requests in flight")
    ax.plot(t, [r["decode_running"] for r in rows], label="decode running")
    ax.set_ylabel("requests")
    ax.legend(loc="upper left")
    ax = axes[1]
    ax.plot(t, [r["decode_waiting"] for r in rows], label="decode waiting")
    ax.plot(t, [r["prefill_queue"] for r in rows], label="prefill queue")
    ax.plot(
        t, [r["prefill_waiting"] + r["prefill_running"] for r in rows], label="on prefill workers"
    )
    ax.set_ylabel("queued")
    ax.legend(loc="upper left")
    ax = axes[2]
    ax.plot(t, [100 * r["decode_kv_usage"] for r in rows], label="decode")
    ax.plot(t, [100 * r["prefill_kv_usage"] for r in rows], label="prefill")
    ax.set_ylabel("KV used (%)")
    ax.legend(loc="upper left")
    ax = axes[3]
    seconds = sorted(recorder.token_bins)
    ax.plot(seconds, [recorder.token_bins[s] for s in seconds], drawstyle="steps-post")
    ax.set_ylabel("output tok/s")
    ax.set_xlabel("simulated time (s)")
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
