"""A tensor-parallel group over two "hosts": rank 0's engine with its neighbour rank
on one, `diptych tp-node` running the other two ranks on the other, meeting through
rank 0's TCP store and talking gloo (not shared memory, as across machines). Real
processes in a private network namespace (the store listens on every interface):
greedy tokens in fp32 are TP 1's, and the node process exits 0 once the engine closes.
A decode worker so split that would take remote prefills refuses to start: the other
host's ranks' KV pools are out of its transfer agent's reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.config import EngineConfig
from tests.e2e.test_tp_rank_kill import tiny_llama

pytestmark = pytest.mark.slow

PROMPTS = [[1, 17, 923, 44, 5, 2048, 77], [3, 3, 3, 400, 12]]

_SCRIPT = textwrap.dedent(
    """
    import json, subprocess, sys
    from transfer.testing import bring_loopback_up
    bring_loopback_up()
    from engine import LLM
    from engine.config import EngineConfig
    from protocol.sampling import SamplingParams

    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    leader = "127.0.0.1:29533"
    node = subprocess.Popen([sys.executable, "-m", "diptych.cli", "tp-node",
                             "--leader", leader, "--node", "1"])
    config = EngineConfig(model=model, dtype="float32", num_blocks=64, threads=1,
                          tensor_parallel_size=4, tensor_parallel_nodes=2,
                          tensor_parallel_leader=leader)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM.from_config(config) as llm:
        out = [r.token_ids for r in llm.generate(prompts, params)]
    first = node.wait(60)

    # a decode worker over the two hosts that would take remote prefills: only its own
    # host's ranks' pools are in its agent's reach, so it refuses to start
    leader = "127.0.0.1:29534"
    node = subprocess.Popen([sys.executable, "-m", "diptych.cli", "tp-node",
                             "--leader", leader, "--node", "1"])
    worker = subprocess.run(
        [sys.executable, "-m", "diptych.cli", "decode", "--model", model, "--dtype",
         "float32", "--num-blocks", "64", "--threads", "1", "--tensor-parallel-size", "4",
         "--tensor-parallel-nodes", "2", "--tensor-parallel-leader", leader,
         "--state-dir", sys.argv[3], "--transfer", "tcp"],
        capture_output=True, text=True, timeout=240)
    refused = worker.returncode != 0 and "reachable by transfer" in worker.stderr
    print(json.dumps({"tokens": out, "node": first, "refused": refused,
                      "node_after": node.wait(60), "stderr": worker.stderr[-2000:]}))
    """
)


def test_a_group_over_two_hosts_gives_tp1s_tokens(tmp_path: Path) -> None:
    from engine import LLM
    from protocol.sampling import SamplingParams

    model = tiny_llama(tmp_path / "tiny-llama")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM.from_config(EngineConfig(model=str(model), dtype="float32", num_blocks=64)) as llm:
        want = [r.token_ids for r in llm.generate(PROMPTS, params)]
    env = {**os.environ, "DIPTYCH_TP_HOST": "127.0.0.1"}
    run = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", _SCRIPT, str(model), json.dumps(PROMPTS),
         str(tmp_path / "state")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["node"] == 0
    assert got["tokens"] == want
    assert got["refused"], got["stderr"]
    assert got["node_after"] in (0, 1)  # its group ended with the worker, either way


def test_a_group_over_hosts_must_say_where_rank_0_listens() -> None:
    with pytest.raises(ValueError, match="must be host:port"):
        EngineConfig(tensor_parallel_size=4, tensor_parallel_nodes=2)
    with pytest.raises(ValueError, match="does not split over 3 nodes"):
        EngineConfig(tensor_parallel_size=4, tensor_parallel_nodes=3, tensor_parallel_leader="a:1")
