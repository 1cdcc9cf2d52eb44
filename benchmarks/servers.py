"""OpenAI-compatible servers as subprocesses, for the serving benchmarks.

Each server runs in its own process group on a free loopback port, logs into a file,
and counts as ready once /v1/models answers 200. `stop()` sends SIGINT to the
group, then SIGTERM, then SIGKILL.

    with diptych_server("aggregated") as s:      # or "disaggregated"
        ... s.url ...
    with llama_cpp_server(gguf_path) as s: ...
    with transformers_server(hf_checkpoint(gguf_path)) as s: ...
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "SmolLM2-135M-Instruct"


class ServerUnavailable(RuntimeError):
    """The server could not be started here (missing package, no weights offline, ...)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(
        self,
        name: str,
        cmd: list[str],
        port: int,
        *,
        env: dict[str, str] | None = None,
        startup_timeout: float = 600.0,
    ) -> None:
        self.name = name
        self.cmd = cmd
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_timeout = startup_timeout
        self.workdir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        self.log_path = self.workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            env=self.env,
            start_new_session=True,
        )
        end = time.monotonic() + self.startup_timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise ServerUnavailable(f"{self.name} exited at start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerUnavailable(f"{self.name} not ready in {self.startup_timeout:.0f} s")

    def manifest(self, timeout: float = 60.0) -> dict[str, Any]:
        """`diptych serve`'s serve.json (its children's endpoints). The frontend answers
        before the launcher writes it, once every child is ready: wait for it."""
        path = self.workdir / "state" / "serve.json"
        end = time.monotonic() + timeout
        while not path.exists():
            if time.monotonic() > end or (self.proc is not None and self.proc.poll() is not None):
                raise ServerUnavailable(f"{self.name} wrote no serve.json:\n{self.log_tail()}")
            time.sleep(0.2)
        doc: dict[str, Any] = json.loads(path.read_text())
        return doc

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 20)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.workdir / "state", ignore_errors=True)


def scrape(url: str) -> dict[str, float]:
    """A server's Prometheus samples (``url``/metrics), name{labels} -> value."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def diptych_server(mode: str, *flags: str) -> ServerProcess:
    """`diptych serve`, aggregated (decode workers only) or disaggregated (1 + 1)."""
    if mode not in ("aggregated", "disaggregated"):
        raise ValueError(f"mode must be aggregated or disaggregated, not {mode!r}")
    port = free_port()
    mode_flags = ["--prefill-workers", "0"] if mode == "aggregated" else []
    cmd = [
        sys.executable,
        "-m",
        "diptych.cli",
        "serve",
        "--port",
        str(port),
        "--state-dir",
        "state",
        *mode_flags,
        *flags,
    ]
    return ServerProcess(f"diptych-{mode}", cmd, port, env={"PYTHONPATH": str(ROOT)})


def llama_cpp_server(
    gguf: Path, *, python: str = sys.executable, threads: int | None = None, n_ctx: int = 4096
) -> ServerProcess:
    """llama-cpp-python's OpenAI server on the same GGUF file (one request at a time).

    Its server runs one request at a time (a lock around one llama.cpp context), so
    concurrent requests queue; all CPU threads for decode and prefill.
    """
    probe = subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True)
    if probe.returncode != 0:
        raise ServerUnavailable(
            "llama-cpp-python is not installed: pip install 'llama-cpp-python[server]'"
        )
    port = free_port()
    cmd = [
        python,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model_alias",
        MODEL_NAME,
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        str(threads or os.cpu_count() or 1),
        # By default a new request interrupts the one being streamed; a benchmark with
        # more than one request in flight then measures truncated outputs.
        "--interrupt_requests",
        "False",
    ]
    return ServerProcess("llama-cpp-python", cmd, port)


def native_llama_server(
    binary: Path, gguf: Path, *, threads: int | None = None, slots: int = 1, n_ctx: int = 4096
) -> ServerProcess:
    """llama.cpp's own `llama-server` (built from the sources vendored in the
    llama-cpp-python sdist, `benchmarks/README` style: cmake -DLLAMA_BUILD_SERVER=ON) on
    the same GGUF, `slots` parallel sequences sharing `n_ctx` x slots of context."""
    if not binary.is_file():
        raise ServerUnavailable(f"no llama-server binary at {binary}")
    port = free_port()
    cmd = [
        str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--alias", MODEL_NAME, "--threads", str(threads or os.cpu_count() or 1),
        "--parallel", str(slots), "--ctx-size", str(n_ctx * slots), "--no-webui",
    ]  # fmt: skip
    return ServerProcess("llama-server", cmd, port)


def hf_checkpoint(gguf: Path, cache: Path | None = None) -> Path:
    """A safetensors copy of a GGUF model (bfloat16), made once, offline, with transformers.

    `transformers serve` can read a GGUF itself, but its loader then finds no
    architecture in the config and fails, and a GGUF-quantized model cannot be saved
    with `save_pretrained`; so the dequantized weights are written out directly.
    """
    out = cache or Path.home() / ".cache" / "diptych" / "bench" / f"{gguf.stem}-hf"
    if (out / "model.safetensors").is_file():
        return out
    script = f"""
import torch
from pathlib import Path
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
src, out = Path({str(gguf)!r}), Path({str(out)!r})
m = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
sd = {{k: v.contiguous() for k, v in m.state_dict().items()}}
if m.config.tie_word_embeddings:
    sd.pop("lm_head.weight", None)
tmp = out.with_name(out.name + ".tmp")
tmp.mkdir(parents=True, exist_ok=True)
cfg = m.config
cfg.architectures = [type(m).__name__]
if hasattr(cfg, "quantization_config"):
    del cfg.quantization_config
cfg.save_pretrained(tmp)
tok.save_pretrained(tmp)
m.generation_config.save_pretrained(tmp)
save_file(sd, tmp / "model.safetensors", metadata={{"format": "pt"}})
tmp.rename(out)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise ServerUnavailable(f"could not convert {gguf} for transformers: {done.stderr[-500:]}")
    return out


def transformers_server(
    model_dir: Path, *, continuous_batching: bool = True, dtype: str = "bfloat16"
) -> ServerProcess:
    """`transformers serve` with a local checkpoint preloaded, offline."""
    exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
    if exe is None:
        raise ServerUnavailable("the `transformers` command is not installed")
    port = free_port()
    cb = "--continuous-batching" if continuous_batching else "--no-continuous-batching"
    cmd = [
        exe,
        "serve",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        dtype,
        cb,
    ]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return ServerProcess("transformers-serve", cmd, port, env=env)
