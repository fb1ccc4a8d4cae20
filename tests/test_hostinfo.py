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
