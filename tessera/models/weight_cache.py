"""A cache of a model's weights as the kernels use them, memory-mapped on later starts.

No packaged model's format is what the kernels read: Q4_K/Q4_1 blocks are repacked into
PyTorch's int4pack tiles, Q6_K's codes and scales unpacked to int8 groups, norms converted to the compute dtype.
That costs 5-40 s a start (qwen2.5-coder-1.5b: ~20 s on 2 cores) and gives each server process
its own copy. So the first load writes every module's loaded state (buffers, bias, the chosen
quantization method and the few flags it set) to one file under
$TESSERA_HOME/packed/, and later loads of the same model with the same settings map that file
(`torch.load(mmap=True)`): start-up becomes the time to read a header, and pages come from the
OS page cache, shared by every server of that model on the machine (private copy-on-write
mappings; weights are never written).

The key covers everything that changes the packed bytes: the weights' sha256, dtype,
quantization settings, Tessera's source and torch's version, and the host's part (the int4pack
layout PyTorch uses on this CPU, and which of Tessera's kernels run here, which decides flags
the layers keep): a cache directory shared by machines of different CPUs never hands one's
tiles to the other. Each model keeps the files of its KEEP_PER_MODEL most recently used settings
(a machine that runs one model two ways, say a server and a float32 evaluation, does not repack
at every start; older settings and Tessera versions are removed).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from tessera.kernels import capabilities, library
from tessera.layers.quantization import (DenseMethod, Int4Method, Int8Method, MXFP4Method, Q4KMethod, Q6KMethod,
                                         QuantConfig, int4pack_layout)

logger = logging.getLogger(__name__)

FORMAT = 1
KEEP_PER_MODEL = 3
_METHODS = {cls.__name__: cls for cls in (DenseMethod, Int4Method, Int8Method, Q6KMethod, Q4KMethod,
                                                  MXFP4Method)}
_SIMPLE = (bool, int, float, str, type(None))


def cache_path(root: Path, model_sha256: str, quant: QuantConfig, extra: str = "") -> Path:
    from tessera.hostinfo import source_digest

    built = library.available() is None
    host = (int4pack_layout(), built, built and capabilities.bf16_matmuls(), built and capabilities.int4_i8_matmuls(),
            built and capabilities.avx2_matmuls())
    key = hashlib.sha256(repr((FORMAT, model_sha256, repr(quant), extra, source_digest(),
                               torch.__version__, host)).encode()).hexdigest()[:20]
    return root / f"{model_sha256[:16]}-{key}.pt"


def _module_state(module: nn.Module) -> dict[str, Any]:
    """What loading set on one module: its buffers, tensor attributes, method and simple flags."""
    # Every name, aliases included: named_buffers' default de-duplication would drop a buffer
    # registered twice under two names (the restored layer would then lack one).
    state: dict[str, Any] = {"buffers": {n: b for n, b in module.named_buffers(recurse=False, remove_duplicate=False)},
                             "tensors": {}, "attrs": {}, "method": None}
    for name, value in vars(module).items():
        if name.startswith("_") or name == "training":
            continue
        if isinstance(value, torch.Tensor):
            state["tensors"][name] = value
        elif isinstance(value, _SIMPLE):
            state["attrs"][name] = value
    method = getattr(module, "quant_method", None)
    if method is not None:
        state["method"] = type(method).__name__
    return state


def save(model: nn.Module, path: Path) -> None:
    """Write the loaded model's state to `path` (temp file + rename); the same model's files
    beyond the KEEP_PER_MODEL most recently used are removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    states = {name: _module_state(m) for name, m in model.named_modules()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"format": FORMAT, "modules": states}, tmp)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not write the packed-weight cache %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return
    _drop_least_recent(path)
    logger.info("packed weights cached in %s (%.0f MiB, %.1f s); later starts map them",
                path, path.stat().st_size / 2**20, time.perf_counter() - t0)


def _drop_least_recent(path: Path) -> None:
    """Remove the files of `path`'s model beyond the KEEP_PER_MODEL most recently used (restore
    marks a file used by its modification time)."""
    files = []
    for f in path.parent.glob(f"{path.name.split('-')[0]}-*.pt"):
        try:
            files.append((f.stat().st_mtime, f))
        except OSError:  # removed meanwhile by another process
            continue
    for _, old in sorted(files, reverse=True)[KEEP_PER_MODEL:]:
        if old != path:
            old.unlink(missing_ok=True)


def restore(model: nn.Module, path: Path, quant: QuantConfig) -> bool:
    """Fill a freshly built (unloaded) model from `path`, tensors mapped from the file; False if
    the file is unusable (then the caller loads from the checkpoint as usual)."""
    try:
        data = torch.load(path, mmap=True, weights_only=True)
    except Exception as exc:  # a truncated or foreign file: load normally, it gets rewritten
        logger.warning("ignoring the packed-weight cache %s: %s", path, exc)
        return False
    modules = dict(model.named_modules())
    states: Optional[dict] = data.get("modules") if isinstance(data, dict) else None
    if data.get("format") != FORMAT or states is None or set(states) != set(modules):
        logger.warning("ignoring the packed-weight cache %s: it does not match this model", path)
        return False
    try:
        os.utime(path)  # used now: kept over the model's less recent settings (_drop_least_recent)
    except OSError:  # a read-only cache directory still serves
        pass
    for name, state in states.items():
        module = modules[name]
        for key, value in state["attrs"].items():
            setattr(module, key, value)
        for key, tensor in state["buffers"].items():
            module.register_buffer(key, tensor, persistent=False)
        for key, tensor in state["tensors"].items():
            setattr(module, key, tensor)
        if state["method"] is not None:
            module.quant_method = _METHODS[state["method"]](quant)
    return True
