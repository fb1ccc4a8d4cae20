"""Kernel variants of another architecture, cross-compiled and run under qemu's user-mode emulation.

The aarch64 variants (isa.LEVELS["aarch64"]: scalar, neon) are built from the same sources with
aarch64-linux-gnu-gcc, each with library.CFLAGS (less -mtune=native, which names the build host's
CPU) and its level's flags; variant_check.c is built with the same compiler, and all of it runs as
`qemu-aarch64 -L /usr/aarch64-linux-gnu variant_check REF.so VARIANT.so` (Debian:
gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; libgomp1-arm64-cross comes with the compiler).
Builds are kept under $TESSERA_HOME/kernels/cross-<arch>/ by a digest of their sources and flags.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tessera.kernels import isa, library

DRIVER = Path(__file__).with_name("variant_check.c")


@dataclass(frozen=True)
class Target:
    arch: str     # isa.LEVELS key
    cc: str       # cross compiler
    qemu: str     # user-mode emulator
    sysroot: str  # the target's libraries (qemu -L)


TARGETS = {"aarch64": Target("aarch64", "aarch64-linux-gnu-gcc", "qemu-aarch64", "/usr/aarch64-linux-gnu")}


def missing_tools(target: Target) -> list[str]:
    """What this host lacks to build and run `target`'s variants (empty: nothing)."""
    missing = [tool for tool in (target.cc, target.qemu) if shutil.which(tool) is None]
    for path in ("include/stdio.h", "lib/libgomp.so.1"):  # the C library's headers, OpenMP's runtime
        if not (Path(target.sysroot) / path).is_file():
            missing.append(f"{target.sysroot}/{path}")
    return missing


def flags(variant: isa.Variant) -> list[str]:
    return [f for f in library.CFLAGS if not f.startswith("-mtune=")] + list(variant.flags)


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _out_dir(target: Target) -> Path:
    path = library.kernel_dir() / f"cross-{target.arch}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_variant(target: Target, name: str, source_dir: Path = library.SOURCE_DIR) -> Path:
    """Variant `name` of `target`'s levels built from `source_dir` (once per sources and flags)."""
    variant = next(v for v in isa.LEVELS[target.arch] if v.name == name)
    cflags = flags(variant)
    text = "".join((source_dir / f).read_text() for f in library.SOURCES + library.HEADERS)
    path = _out_dir(target) / f"tessera_kernels-{name}-{_digest(text, *cflags, target.cc)}.so"
    if path.is_file():
        return path
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        objects = [str(Path(tmp) / (src + ".o")) for src in library.SOURCES]
        jobs = [[target.cc, *cflags, "-c", str(source_dir / src), "-o", obj] for src, obj in zip(library.SOURCES, objects)]
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            list(pool.map(_run, jobs))
        partial = Path(tmp) / "lib.so"
        _run([target.cc, *cflags, "-shared", *objects, "-o", str(partial), "-lm"])
        os.replace(partial, path)
    return path


def build_driver(cc: str, out_dir: Path, source_dir: Path = library.SOURCE_DIR) -> Path:
    """variant_check.c built with `cc` (the host's compiler or a cross one) into out_dir."""
    text = DRIVER.read_text() + (source_dir / "tessera_kernels.h").read_text()
    path = Path(out_dir) / f"variant_check-{Path(cc).name}-{_digest(text, cc)}"
    if not path.is_file():
        partial = path.with_suffix(".partial")
        _run([cc, "-O2", "-std=gnu11", "-Wall", "-I", str(source_dir), str(DRIVER), "-o", str(partial), "-ldl", "-lm"])
        os.replace(partial, path)
    return path


def run_check(target: Optional[Target], driver: Path, ref: Path, variant: Path, *cases: str, verbose: bool = False,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """The driver on (ref, variant), natively (target None) or under target's qemu: every case, or
    those whose names start with one of `cases`; `verbose`: each case's error."""
    cmd = [str(driver), *(["-v"] if verbose else []), str(ref), str(variant), *cases]
    if target is not None:
        cmd = [target.qemu, "-L", target.sysroot, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
