"""Reading GGUF files: metadata into a ModelConfig, tensors into float weights.

The header is parsed here rather than with `gguf.GGUFReader`: the reader builds
one numpy memmap per vocabulary entry, which costs 2 s for SmolLM2's 49k tokens
and 10 s for Gemma's 262k on this machine, while the model needs none of them
(the tokenizer comes from its own cache, see tessera.tokenizer). The format's
constants and every dequantization kernel still come from the `gguf` package.

Tensors come out under Hugging Face parameter names with Hugging Face value
conventions (llama.cpp's Q/K row permutation undone, Gemma's `1 + w` norms
stored as `w`), so one model module serves both GGUF files and HF folders.

Reading the header and the config needs neither torch nor the layers: a process that only
tokenizes for an engine elsewhere (the API server's) reads them and stays free of torch's
memory. The weight readers import them where they are called.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Union

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf.quants import dequantize

from tessera.config import ModelConfig
from tessera.errors import ModelFormatError
from tessera.models.families import FAMILIES, Family, family

if TYPE_CHECKING:
    import torch

    from tessera.layers.weights import GGUFWeight

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------------
# metadata -> ModelConfig


def config_from_gguf(gf: GGUFFile, name: str = "") -> ModelConfig:
    """Network shape from GGUF metadata (llama.cpp key names): the keys every decoder has, then
    the family's own (tessera/models/families)."""
    arch = gf.architecture
    try:
        fam = family(arch)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{gf.path.name}: {exc}") from None

    def need(key: str) -> Any:
        value = gf.arch_key(key)
        if value is None:
            raise ModelFormatError(f"{gf.path.name}: metadata key {arch}.{key} is missing; the file is incomplete")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    num_kv_heads = gf.arch_key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):  # per-layer counts; all our architectures use one value
        num_kv_heads = max(num_kv_heads)
    # Not rope.dimension_count: with partial rotary (Phi-3) it is less than a head.
    head_dim = gf.arch_key("attention.key_length") or hidden // num_heads
    ffn = gf.arch_key("feed_forward_length") or need("expert_feed_forward_length")
    if isinstance(ffn, list):
        ffn = max(ffn)
    if "token_embd.weight" not in gf.tensors:
        raise ModelFormatError(f"{gf.path.name} has no token_embd.weight tensor; the file is incomplete")
    vocab = gf.arch_key("vocab_size") or gf.tensors["token_embd.weight"].shape[0]

    eos = gf.metadata.get("tokenizer.ggml.eos_token_id")
    eot = gf.metadata.get("tokenizer.ggml.eot_token_id")
    eos_ids = [int(t) for t in (eos, eot) if t is not None]

    file_type = gf.metadata.get("general.file_type")
    try:
        quant = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        quant = ""

    cfg = ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(gf.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gf.arch_key("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gf),
        max_position_embeddings=int(gf.arch_key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in gf.tensors,
        attention_bias="blk.0.attn_q.bias" in gf.tensors or "blk.0.attn_qkv.bias" in gf.tensors,
        bos_token_id=gf.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        name=name or gf.path.stem,
        quantization=quant,
    )
    if fam.from_gguf is not None:
        try:
            fam.from_gguf(gf, cfg)
        except (TypeError, ValueError) as exc:
            raise ModelFormatError(f"{gf.path.name}: bad {arch} metadata ({exc})") from None
    _check_shapes(gf, cfg, fam)
    return cfg


def _check_shapes(gf: GGUFFile, cfg: ModelConfig, fam: Family) -> None:
    """The metadata must agree with the tensors the file holds: the model is built from the
    metadata before any weight loads, so absurd values (a fuzzed or hostile header) would otherwise
    become absurd allocations. Tensor sizes are bounded by the file's size, so this bounds them."""
    def fail(what: str) -> ModelFormatError:
        return ModelFormatError(f"{gf.path.name}: {what}; the file is corrupt or not a model Tessera can run")

    for field_name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "max_position_embeddings"):
        if getattr(cfg, field_name) <= 0:
            raise fail(f"{field_name} is {getattr(cfg, field_name)}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise fail(f"{cfg.num_heads} attention heads do not divide into {cfg.num_kv_heads} KV heads")
    q, kv, last = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_layers - 1
    expected = {"token_embd.weight": (cfg.vocab_size, cfg.hidden_size)}
    if fam.fused_projections:
        expected.update({"blk.0.attn_qkv.weight": (q + 2 * kv, cfg.hidden_size),
                         "blk.0.ffn_up.weight": (2 * cfg.intermediate_size, cfg.hidden_size),
                         f"blk.{last}.attn_qkv.weight": (q + 2 * kv, cfg.hidden_size)})
    else:
        expected.update({"blk.0.attn_q.weight": (q, cfg.hidden_size), "blk.0.attn_k.weight": (kv, cfg.hidden_size),
                         f"blk.{last}.attn_q.weight": (q, cfg.hidden_size)})
        moe = cfg.moe
        if moe is not None and moe.is_sparse(0):
            expected.update({"blk.0.ffn_gate_inp.weight": (moe.num_experts, cfg.hidden_size),
                             "blk.0.ffn_up_exps.weight": (moe.num_experts, moe.expert_ffn, cfg.hidden_size)})
        else:
            expected["blk.0.ffn_up.weight"] = (cfg.intermediate_size, cfg.hidden_size)
    for name, shape in expected.items():
        info = gf.tensors.get(name)
        if info is None:
            raise fail(f"tensor {name} is missing (the metadata says {cfg.num_layers} layers)")
        if tuple(info.shape) != shape:
            raise fail(f"tensor {name} has shape {tuple(info.shape)}, the metadata implies {shape}")


def _rope_scaling(gf: GGUFFile) -> Optional[dict[str, Any]]:
    kind = gf.arch_key("rope.scaling.type")
    factor = gf.arch_key("rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(gf.arch_key("rope.scaling.original_context_length"))}
        for key, hf_key in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            if gf.arch_key(key) is not None:
                scaling[hf_key] = float(gf.arch_key(key))
        return scaling
    raise ModelFormatError(
        f"{gf.path.name}: RoPE scaling type {kind!r} is not supported (linear and yarn are); use another model file"
    )


# ---------------------------------------------------------------------------
# tensors -> HF-named weights

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3-style per-frequency divisors
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, and each projection's experts stacked [E, out, in]
    # (split per expert by models/decoder.py).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "attn_sinks": "self_attn.sinks",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


# Tensors the family's config reader takes (LongRoPE's factors), not weights.
CONFIG_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})


def hf_name(gguf_name: str, arch: str) -> Optional[str]:
    """Hugging Face parameter name of a GGUF tensor, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m:
        return None
    layer, part, kind = m.groups()
    fam = FAMILIES.get(arch)
    if part == "ffn_norm":
        # The pre-MLP norm: llama's post_attention_layernorm; Gemma's has that name for another.
        target = "pre_feedforward_layernorm" if fam is not None and fam.block.post_norms else "post_attention_layernorm"
    elif part == "attn_qkv":
        target = "self_attn.qkv_proj"
    elif part == "ffn_up" and fam is not None and fam.fused_projections:
        target = "mlp.gate_up_proj"  # Phi-3: gate rows, then up rows
    else:
        target = _LAYER_NAMES.get(part)
        if target is None:
            return None
    return f"model.layers.{layer}.{target}.{kind}"


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (interleaved -> half-split RoPE)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_weights(
    gf: GGUFFile, config: ModelConfig, num_threads: Optional[int] = None,
) -> Iterator[tuple[str, Union[torch.Tensor, GGUFWeight]]]:
    """Yield (HF name, weight) pairs: quantized matrices as their raw GGUF blocks (a
    `GGUFWeight`, memory-mapped, so a quantization method can take the 4-bit codes over
    exactly), everything else as float32 tensors.

    Q/K rows are un-permuted on the raw blocks (blocks never cross rows). Float
    tensors are read on a thread pool (numpy releases the GIL while converting).
    """
    import torch

    from tessera.layers.weights import FLOAT_TYPES

    arch = config.architecture
    fam = family(arch)
    jobs = []
    for name in gf.tensors:
        target = hf_name(name, arch)
        if target is None and name in CONFIG_TENSORS:
            continue
        if target is None:
            logger.warning("ignoring tensor %s in %s (not used by the %s model)", name, gf.path.name, arch)
            continue
        jobs.append((name, target))

    def load(job: tuple[str, str]) -> tuple[str, Union[torch.Tensor, GGUFWeight]]:
        name, target = job
        info = gf.tensors[name]
        qk_heads = None
        if fam.gguf_permuted_qk and (".attn_q." in name or ".attn_k." in name):
            qk_heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
        if len(info.shape) in (2, 3) and info.ggml_type not in FLOAT_TYPES:  # 3-D: MoE experts, stacked rows
            w = gf.raw_weight(name)
            if qk_heads is not None:
                w = w.permute_rows(_unpermute_qk(np.arange(info.shape[0]), qk_heads))
            return target, w
        w = gf.dequantize(name)
        if qk_heads is not None:
            w = _unpermute_qk(w, qk_heads)
        if fam.block.norm_offset and name.endswith("norm.weight"):
            w = w - fam.block.norm_offset  # llama.cpp stores Gemma's (1 + w) norm scale; HF keeps w
        return target, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    workers = max(1, num_threads or torch.get_num_threads())
    with ThreadPoolExecutor(max_workers=workers) as pool:
        previous: Optional[str] = None
        for (name, _), item in zip(jobs, pool.map(load, jobs)):
            if previous is not None:
                gf.release(previous)  # consumed (or waiting as a view that re-reads on demand)
            yield item
            previous = name
        if previous is not None:
            gf.release(previous)
