"""Reading GGUF files: the header and tensor table parsed, tensor bytes memory-mapped.

The header is parsed here rather than with `gguf.GGUFReader`: the reader builds
one numpy memmap per vocabulary entry, which costs 2 s for SmolLM2's 49k tokens
and 10 s for Gemma's 262k on this machine, while the model needs none of them
(the tokenizer comes from its own cache, see tessera.tokenizer). The format's
constants and every dequantization kernel still come from the `gguf` package.
Reading needs neither torch nor the layers (gguf_loader.py turns a file into a config and weights).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tessera.errors import ModelFormatError

if TYPE_CHECKING:
    from tessera.layers.weights import GGUFWeight

Q = GGMLQuantizationType
# Types gguf.quants dequantizes and that llama.cpp's usual quant mixes produce.
SUPPORTED_TENSOR_TYPES = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
    Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4,
})

_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DEQUANT_CHUNK = 1 << 20  # values per dequantize call


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first)
    ggml_type: GGMLQuantizationType
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class StringArray:
    """A string array left unread (vocabularies): only its length is kept."""

    count: int


class GGUFFile:
    """An open GGUF file: parsed metadata and tensor table, tensor bytes memory-mapped."""

    def __init__(self, path: Path, metadata: dict[str, Any], tensors: dict[str, TensorInfo], buf: mmap.mmap):
        self.path = path
        self.metadata = metadata
        self.tensors = tensors
        self._buf = buf

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32 in torch shape order."""
        info = self.tensors[name]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.start)
        if info.ggml_type == Q.F32:
            return raw.view(np.float32).reshape(info.shape).copy()
        if info.ggml_type == Q.F16:
            return raw.view(np.float16).astype(np.float32).reshape(info.shape)
        if len(info.shape) < 2:
            return dequantize(raw, info.ggml_type).reshape(info.shape)
        # Row chunks of about a million values: gguf's kernels make several temporaries per
        # value, and keeping them cache-sized is 4-6x faster than one call for a whole matrix.
        cols = info.shape[-1]
        rows = raw.reshape(-1, info.nbytes // (int(np.prod(info.shape[:-1])) or 1))
        out = np.empty((rows.shape[0], cols), dtype=np.float32)
        step = max(1, _DEQUANT_CHUNK // cols)
        for i in range(0, rows.shape[0], step):
            out[i:i + step] = dequantize(rows[i:i + step], info.ggml_type)
        return out.reshape(info.shape)

    def raw_weight(self, name: str) -> GGUFWeight:
        """A quantized matrix's blocks, undecoded: [rows, bytes per row] over the mapped file (a
        view, nothing copied). A 3-D tensor (MoE experts, [n_expert, rows, cols]) comes as the
        [n_expert * rows, bytes per row] matrix of every expert's rows, `experts` set:
        `GGUFWeight.expert(e)` is expert e's rows, again a view of the file."""
        from tessera.layers.weights import GGUFWeight

        info = self.tensors[name]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.start)
        rows = int(np.prod(info.shape[:-1]))
        experts = info.shape[0] if len(info.shape) == 3 else 1
        return GGUFWeight(raw.reshape(rows, -1), info.ggml_type, (rows, info.shape[-1]), experts)

    def release(self, name: str) -> None:
        """Drop the resident pages of one tensor's bytes: they were read once, and clean
        file-backed pages would otherwise count in the process's resident memory until
        the file is closed (a 1 GB model would hold 1 GB of them at the end of loading)."""
        info = self.tensors[name]
        page = mmap.PAGESIZE
        start = info.start - info.start % page
        try:
            self._buf.madvise(mmap.MADV_DONTNEED, start, info.start + info.nbytes - start)
        except (AttributeError, OSError, ValueError):  # no madvise on this platform: harmless
            pass

    def header_bytes(self) -> bytes:
        """The metadata and tensor table (everything before the tensor data)."""
        start = min((t.start for t in self.tensors.values()), default=len(self._buf))
        return self._buf[:start]

    def close(self) -> None:
        try:
            self._buf.close()
        except BufferError:  # a raw weight still maps it; the mapping goes when that weight does
            pass


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header and tensor table; raise ModelFormatError for anything unusable."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: empty file
        raise ModelFormatError(f"cannot read {path}: {exc}; check the file exists and is not empty") from None
    try:
        metadata, tensors = _parse_header(buf, path)
    except ModelFormatError:
        buf.close()
        raise
    except (struct.error, UnicodeDecodeError, IndexError, ValueError, OverflowError, MemoryError):
        buf.close()
        raise ModelFormatError(
            f"{path.name} has a corrupt or truncated GGUF header; re-download the model (`tessera pull`)"
        ) from None
    return GGUFFile(path, metadata, tensors, buf)


def _parse_header(buf: mmap.mmap, path: Path) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    if buf[:4] != b"GGUF":
        raise ModelFormatError(f"{path.name} is not a GGUF file (bad magic bytes); pass a .gguf model file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ModelFormatError(f"{path.name} is GGUF version {version}; only versions 2 and 3 are supported")
    size = len(buf)
    if n_tensors > size or n_kv > size:
        raise ModelFormatError(f"{path.name} has a corrupt GGUF header; re-download the model (`tessera pull`)")
    pos = 24
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = _read_string(buf, pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, vtype)
    entries = []
    for _ in range(n_tensors):
        name, pos = _read_string(buf, pos)
        (ndim,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        entries.append((name, tuple(reversed(dims)), ttype, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = (pos + alignment - 1) // alignment * alignment

    tensors: dict[str, TensorInfo] = {}
    end = data_start
    for name, shape, ttype, offset in entries:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            qtype = None
        if qtype not in SUPPORTED_TENSOR_TYPES:
            type_name = qtype.name if qtype is not None else f"#{ttype}"
            raise ModelFormatError(
                f"{path.name}: tensor {name} has type {type_name}, which Tessera cannot dequantize; "
                f"use a file quantized as {', '.join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))}"
            )
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if n % block:
            raise ModelFormatError(f"{path.name}: tensor {name} is not a whole number of {qtype.name} blocks")
        info = TensorInfo(name, shape, qtype, data_start + offset, n // block * type_size)
        tensors[name] = info
        end = max(end, info.start + info.nbytes)
    if end > size:
        raise ModelFormatError(
            f"{path.name} is truncated: its tensors need {end} bytes but the file has {size}; "
            "re-download the model (`tessera pull`)"
        )
    return metadata, tensors


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    if pos + n > len(buf):
        raise ValueError("string runs past the end of the file")
    return buf[pos:pos + n].decode("utf-8"), pos + n


def _read_value(buf: mmap.mmap, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _read_string(buf, pos)
    if vtype == _ARRAY:
        itype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[itype]
            width = struct.calcsize(fmt)
            if pos + count * width > len(buf):
                raise ValueError("array runs past the end of the file")
            return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, pos)), pos + count * width
        if itype == _STRING:
            if count > 64:  # vocabularies and merge lists: skip, the tokenizer reads them
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    pos += 8 + n
                return StringArray(count), pos
            values = []
            for _ in range(count):
                s, pos = _read_string(buf, pos)
                values.append(s)
            return values, pos
        raise ValueError(f"unsupported GGUF array element type {itype}")
    raise ValueError(f"unsupported GGUF value type {vtype}")
