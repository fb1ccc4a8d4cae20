"""Process-tree memory figures the benchmarks sum over a server and its engine processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tessera.hostinfo import process_tree, resident_bytes, tree_proportional_bytes, tree_resident_bytes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc")


def test_tree_figures_take_in_a_child_and_pss_never_exceeds_rss():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while resident_bytes(child.pid) < 64 << 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        me = os.getpid()
        assert child.pid in process_tree(me)
        rss, pss = tree_resident_bytes(me), tree_proportional_bytes(me)
        assert rss >= resident_bytes(me) + (64 << 20)  # the child's 64 MiB buffer is in the sum
        assert 64 << 20 < pss <= rss  # shared pages count once in Pss, in every process in VmRSS
    finally:
        child.kill()
        child.wait()


def test_cuda_probe_agrees_with_torch_and_skips_it_without_a_driver(monkeypatch):
    import torch

    from tessera import hostinfo

    assert hostinfo.cuda_available() == torch.cuda.is_available()
    # no driver and torch not imported yet (the API process): "no" without importing torch
    monkeypatch.setattr(hostinfo, "nvidia_driver_present", lambda: False)
    monkeypatch.delitem(sys.modules, "torch")
    assert hostinfo.cuda_available() is False
    assert "torch" not in sys.modules


def test_lazy_zeros_reads_as_zeros_and_becomes_resident_only_where_written():
    import torch

    from tessera.hostinfo import lazy_zeros, resident_tensor_bytes

    t = lazy_zeros((64, 1024, 256), torch.float32)  # 64 MiB
    assert t.shape == (64, 1024, 256) and t.dtype == torch.float32
    assert resident_tensor_bytes([t]) < 1 << 20
    rss = resident_bytes()
    t[3].fill_(1.0)  # one 1 MiB block
    assert (1 << 20) <= resident_tensor_bytes([t]) < 2 << 20
    assert resident_bytes() - rss < 4 << 20
    assert not t[5].any() and t.sum().item() == 1024 * 256
    assert resident_tensor_bytes([torch.ones(1 << 18)]) >= 1 << 20  # an ordinary tensor is all resident
