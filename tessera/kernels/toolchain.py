"""The C toolchain the kernel library and the CPU probe are built with, and the probe itself.

Apart from library.py so that isa.py can ask the probe which variant this CPU runs while library.py
asks isa.py which variant to build: both import this module, neither imports the other's caller.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
PROBE = "cpu_probe.c"


class KernelUnavailable(RuntimeError):
    pass


def kernel_dir() -> Path:
    home = os.environ.get("TESSERA_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "tessera") / "kernels"


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler (cc/gcc) found")
    return cc


def host_cpu() -> str:
    """The CPU's model and feature flags (-mtune=native and the probe's answer depend on them)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def run(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"compiling the kernels failed: {exc}") from None
    if done.returncode != 0:
        raise KernelUnavailable(f"compiling the kernels failed: {done.stderr.strip()[:2000]}")


@lru_cache(maxsize=1)
def probe_features() -> Optional[int]:
    """cpu_probe.c's answer (isa.FEATURE_BITS), built without instruction-set flags; None where it
    cannot be built or loaded."""
    try:
        cc = compiler()
        text = (SOURCE_DIR / PROBE).read_text() + cc + host_cpu()
        path = kernel_dir() / f"tessera_cpu_probe-{hashlib.sha256(text.encode()).hexdigest()[:16]}.so"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
                partial = Path(tmp) / "probe.so"
                run([cc, "-O2", "-shared", "-fPIC", str(SOURCE_DIR / PROBE), "-o", str(partial)])
                os.replace(partial, path)
        fn = ctypes.CDLL(str(path)).tessera_cpu_features
        fn.restype = ctypes.c_uint64
        return int(fn())
    except (KernelUnavailable, OSError, AttributeError) as exc:
        logger.warning("CPU feature check unavailable (%s); reading /proc/cpuinfo", exc)
        return None


