"""Facts about the host that sizing, kernel choices and the step-cost model's checks depend on
(memory, CPU features, how busy other processes keep it, its measured bandwidth and FLOP/s)."""
from __future__ import annotations

import glob
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch


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


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor whose pages the OS maps only when first written (a private anonymous
    mapping; reads of untouched pages see the shared zero page). torch.zeros writes every
    byte, so a cache sized for 32 sequences of 4,096 tokens is all resident from the start
    whether or not a token is ever stored; this one costs what is written. Huge pages are
    declined for it: one touched block would otherwise fault in 2 MiB."""
    import mmap

    import torch

    n = 1
    for dim in shape:
        n *= dim
    nbytes = n * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def resident_tensor_bytes(tensors: "list[torch.Tensor]") -> Optional[int]:
    """Bytes of these CPU tensors' storage whose pages are resident (mincore), None where the
    call is unavailable. Counts what the KV cache really holds in memory, which VmRSS cannot
    tell apart from the weights and the runtime. An untouched page that was only read maps the
    shared zero page and counts here, not in VmRSS; the cache reads only blocks it wrote."""
    import ctypes
    import mmap

    libc = _libc()
    if libc is None or not hasattr(libc, "mincore"):
        return None
    page = mmap.PAGESIZE
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    total = 0
    for t in tensors:
        nbytes = t.untyped_storage().nbytes()
        if t.device.type != "cpu" or nbytes == 0:
            continue
        start = t.untyped_storage().data_ptr()
        first = start - start % page
        pages = (start + nbytes - first + page - 1) // page
        vec = ctypes.create_string_buffer(pages)
        if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * page), vec) != 0:
            return None
        total += (pages - vec.raw.count(0)) * page  # a page's byte is 1 (low bit) when resident
    return total


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


def others_cpu_seconds() -> Optional[float]:
    """CPU seconds every other process (and the hypervisor, as steal) has used since boot: the
    host's busy time in /proc/stat less this process's own. Read twice around a measurement it
    says how many cores others took meanwhile. None where /proc/stat is absent."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    own = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK") - (own.user + own.system)


@dataclass(frozen=True)
class HostRates:
    """What the step-cost model's roofline check needs of the host: read bandwidth and the FLOP
    rate of a large matrix product in one dtype at the thread count in use."""

    bandwidth: float  # bytes/s, a reduction over a tensor far larger than the caches
    flops: float  # FLOP/s of a 1024 x 1024 product

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.flops > 0):
            raise ValueError(f"host rates must be positive: {self}")


def host_rates(dtype: str, cache_dir: Path, max_other_cores: float = 0.3) -> HostRates:
    """Measured once per host, dtype, thread count and torch version (~0.3 s; the best of three
    of each), and kept in `cache_dir` unless other processes took more than `max_other_cores`
    meanwhile (a busy host's rates would loosen the bounds for every later start)."""
    import torch

    key = "-".join(str(x).replace(" ", "_").replace("/", "_") for x in (
        cpu_model_name(), dtype, torch.get_num_threads(), torch.__version__))
    path = cache_dir / f"rates-{key}.json"
    try:
        return HostRates(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    before, t0 = others_cpu_seconds(), time.perf_counter()
    data = torch.ones(32 << 20, dtype=torch.float32)  # 128 MiB: past any cache
    a, b = torch.randn(1024, 1024).to(getattr(torch, dtype)), torch.randn(1024, 1024).to(getattr(torch, dtype))
    read, mm = float("inf"), float("inf")
    for _ in range(3):
        t = time.perf_counter()
        data.sum()
        read = min(read, time.perf_counter() - t)
        t = time.perf_counter()
        torch.mm(a, b)
        mm = min(mm, time.perf_counter() - t)
    rates = HostRates(data.numel() * data.element_size() / read, 2 * 1024 ** 3 / mm)
    after, wall = others_cpu_seconds(), time.perf_counter() - t0
    if before is not None and after is not None and (after - before) / wall > max_other_cores:
        return rates
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_text(json.dumps(asdict(rates)))
        os.replace(tmp, path)
    except OSError:
        pass
    return rates
