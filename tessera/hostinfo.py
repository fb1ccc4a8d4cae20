"""Facts about the host that sizing and kernel choices depend on (memory, CPU features)."""
from __future__ import annotations

import glob
import os
import sys
from functools import lru_cache
from typing import Optional


def available_memory() -> int:
    """Bytes the kernel reports as available (MemAvailable), 8 GiB if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where unavailable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cuda_available() -> bool:
    """Whether PyTorch sees a CUDA GPU, asked without importing torch where no NVIDIA driver
    exists: a config is resolved in the API process too, and importing torch there only to learn
    "no GPU" costs it ~140 MiB of resident memory for the server's life. With a driver present
    (or torch already imported) torch itself answers."""
    torch = sys.modules.get("torch")
    if torch is None and not nvidia_driver_present():
        return False
    import torch

    return bool(torch.cuda.is_available())


def nvidia_driver_present() -> bool:
    """An NVIDIA kernel driver is loaded (Linux, containers given GPUs) or WSL's GPU bridge is."""
    return (os.path.exists("/proc/driver/nvidia/version") or bool(glob.glob("/dev/nvidia[0-9]*"))
            or os.path.exists("/dev/dxg"))


@lru_cache(maxsize=1)
def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


@lru_cache(maxsize=1)
def source_digest() -> str:
    """A hash of Tessera's own source (Python and C): measurements cached by it expire with any change."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".c") and path.is_file():
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Serve allocations of `threshold` bytes and more with their own mmap (glibc).

    Loading a model makes many large temporaries (dequantized row chunks, int32 codes for
    packing); with glibc's default, the mmap threshold grows after the first ones are freed,
    later ones land on the heap, and the freed heap stays resident: the 1.5B model's load
    peaked ~350 MB higher than it ends. A fixed threshold returns each one on free.
    No-op where glibc's mallopt is missing.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)


def release_free_memory() -> None:
    """Give freed heap memory back to the OS (glibc malloc_trim); no-op elsewhere."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (from /proc/<pid>/task/*/children); just `pid` where absent."""
    from pathlib import Path

    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                pass
    return out


def tree_resident_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (a server and its engine processes)."""
    return sum(resident_bytes(p) for p in process_tree(pid))


def tree_proportional_bytes(pid: int) -> int:
    """Proportional set size (Pss) of a process and its descendants: pages shared between them (a
    model file mapped by both the front-end and the engine) count once in the sum, unlike VmRSS."""
    from pathlib import Path

    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


def resident_bytes(pid: Optional[int] = None) -> int:
    """Resident memory (VmRSS) of a process, this one by default, in bytes; 0 where /proc is absent."""
    from pathlib import Path

    try:
        for line in Path(f"/proc/{pid or 'self'}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
