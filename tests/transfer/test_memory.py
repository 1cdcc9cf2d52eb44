"""Registered memory: shared segments, their names, their cleanup, tensor views."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from transfer import Agent, DescriptorError, sweep_stale_segments
from transfer.shmseg import DEFAULT_DIR, segment_name


def _path(name: str | None) -> str:
    assert name is not None
    return os.path.join(DEFAULT_DIR, name)


def test_allocate_on_shm_agents_uses_private_uniquely_named_segments() -> None:
    with Agent("a", backend="shm") as a, Agent("a", backend="shm") as b:  # same name, same process
        ra, rb = a.allocate(1 << 20), b.allocate(1 << 20)
        assert ra.shm_name != rb.shm_name
        assert a.incarnation in str(ra.shm_name) and b.incarnation in str(rb.shm_name)
        st = os.stat(_path(ra.shm_name))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 1 << 20
        assert a.describe().regions[0].shm == ra.shm_name
    assert not os.path.exists(_path(ra.shm_name)) and not os.path.exists(_path(rb.shm_name))


def test_tcp_agents_allocate_anonymous_memory() -> None:
    with Agent("a", backend="tcp") as a:
        r = a.allocate(4096)
        assert r.shm_name is None and r.address % 4096 == 0
        assert "shm" not in a.describe().regions[0].to_dict()


def test_region_tensor_shares_memory_and_outlives_the_agent() -> None:
    a = Agent("a", backend="shm")
    r = a.allocate(64 * 16)
    kv = r.tensor(torch.float32, (16, 16))
    kv[3, 5] = 42.0
    assert r.numpy().view(np.float32)[3 * 16 + 5] == 42.0
    a.close()  # unlinks the name; the mapping lives on while the tensor does
    assert not os.path.exists(_path(r.shm_name))
    kv += 1  # still valid memory: no crash
    assert kv[3, 5] == 43.0


def test_register_accepts_tensors_and_writable_buffers_only() -> None:
    with Agent("a", backend="tcp") as a:
        t = torch.zeros(8, 4, dtype=torch.bfloat16)
        r = a.register(t)
        assert r.nbytes == 64 and r.address == t.data_ptr()
        r.view()[:2] = b"\x80\x3f"  # 1.0 in bfloat16
        assert t[0, 0].item() == 1.0
        assert a.register(bytearray(10)).nbytes == 10
        with pytest.raises(DescriptorError):
            a.register(b"read-only")
        with pytest.raises(DescriptorError):
            a.register(torch.zeros(4, 4).t())


def test_stale_segments_of_killed_agents_are_swept() -> None:
    code = (
        "import os, signal, sys\n"
        "from transfer import Agent\n"
        "a = Agent('doomed', backend='shm')\n"
        "print(a.allocate(4096).shm_name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL
    name = out.stdout.strip()
    assert os.path.exists(_path(name))  # SIGKILL: nobody cleaned up...
    with Agent("next", backend="shm"):  # ...until the next shm agent on the host starts
        assert not os.path.exists(_path(name))
    with Agent("live", backend="shm") as live:
        mine = live.allocate(4096).shm_name
        assert mine not in sweep_stale_segments()  # a live owner's segment is kept
        assert os.path.exists(_path(mine))


def test_segment_names_encode_owner_and_incarnation() -> None:
    name = segment_name("ab" * 16, 3)
    parts = name.split(".")
    assert parts[0] == "diptych" and parts[2] == str(os.getpid())
    assert parts[4] == "ab" * 16 and parts[5] == "3"
