"""LoRA adapter files, read and checked against their base model without torch.

Two formats: PEFT's folder (`adapter_config.json` + `adapter_model.safetensors`) and llama.cpp's
LoRA GGUF (`general.type = adapter`, tensors `blk.N.<tensor>.weight.lora_a|lora_b`). Reading
one here looks only at the configuration and the tensor headers, so the API process (which never
imports torch) can refuse a bad file with a clear 400 before the engine is told about it; the
engine loads the values with models/lora_weights.py.

An adapter's module is one of the decoder's projections (`TARGETS`): q, k, v, o, gate, up, down,
or a fused qkv / gate_up (Phi-3's checkpoint names), each a low-rank update
`W x + scale * B (A x)` with A [r, in] and B [out, r].
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tessera.config import ModelConfig
from tessera.errors import AdapterError

# Our kind -> (the Linear's prefix under a layer, its parts the kind covers)
TARGETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "q": ("self_attn.qkv_proj", ("q",)), "k": ("self_attn.qkv_proj", ("k",)), "v": ("self_attn.qkv_proj", ("v",)),
    "qkv": ("self_attn.qkv_proj", ("q", "k", "v")), "o": ("self_attn.o_proj", ("o",)),
    "gate": ("mlp.gate_up_proj", ("gate",)), "up": ("mlp.gate_up_proj", ("up",)),
    "gate_up": ("mlp.gate_up_proj", ("gate", "up")), "down": ("mlp.down_proj", ("down",)),
}
# Parts of each adapted Linear, in the order of its output rows.
LINEAR_PARTS: dict[str, tuple[str, ...]] = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": ("o",),
                                            "mlp.gate_up_proj": ("gate", "up"), "mlp.down_proj": ("down",)}
_HF_KINDS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "qkv_proj": "qkv", "gate_proj": "gate",
             "up_proj": "up", "down_proj": "down", "gate_up_proj": "gate_up"}
_GGUF_KINDS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "attn_qkv": "qkv",
               "ffn_gate": "gate", "ffn_down": "down"}
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_(A|B)"
                       r"(?:\.default)?\.weight$")
_GGUF_KEY = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_(a|b)$")
_FLOAT_DTYPES = {"F32", "F16", "BF16"}


@dataclass(frozen=True)
class ModuleLoRA:
    """One adapted module as the file holds it: tensor names of A and B and the module's scale
    (alpha / r, or alpha / sqrt(r) for rsLoRA; per module where PEFT's patterns say)."""

    layer: int
    kind: str  # a key of TARGETS
    a: str
    b: str
    rank: int
    scale: float


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter checked against its base: what the engine needs to load and serve it.
    `digest` (of the weight file) salts the prefix cache's hashes, so KV computed through one
    adapter is never reused by the base or by another adapter, nor by a changed file of the
    same name."""

    name: str
    path: str  # the folder (PEFT) or file (GGUF)
    format: str  # "peft" or "gguf"
    rank: int  # the largest rank of its modules
    targets: tuple[str, ...]
    digest: str
    base_model: Optional[str] = None
    weights_file: str = ""
    modules: tuple[ModuleLoRA, ...] = field(default=(), repr=False)
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted Q/K's B rows as it does the base's


def expected_shapes(model: ModelConfig, kind: str) -> tuple[int, int]:
    """(out, in) of the base projection `kind` adapts."""
    q, kv, h, i = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.hidden_size, \
        model.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "qkv": (q + 2 * kv, h), "o": (h, q), "gate": (i, h),
            "up": (i, h), "gate_up": (2 * i, h), "down": (h, i)}[kind]


def read_adapter(name: str, path: str, model: ModelConfig, max_rank: int) -> AdapterSpec:
    """Check the adapter at `path` for `model`; raises AdapterError saying what is wrong."""
    if not name or not isinstance(name, str):
        raise AdapterError("an adapter needs a non-empty name")
    p = Path(path).expanduser()
    if not p.exists():
        raise AdapterError(f"LoRA adapter {name!r}: {path} does not exist")
    if model.architecture == "bert" or not model.is_causal:
        raise AdapterError(f"LoRA adapters apply to decoders; {model.name or model.architecture} is an encoder")
    if p.is_dir() or p.name == "adapter_config.json":
        spec = _read_peft(name, p if p.is_dir() else p.parent, model)
    elif p.suffix == ".gguf":
        spec = _read_gguf(name, p, model)
    else:
        raise AdapterError(f"LoRA adapter {name!r}: {path} is neither a PEFT folder (adapter_config.json and "
                           "adapter_model.safetensors) nor a .gguf LoRA file")
    if spec.rank > max_rank:
        raise AdapterError(f"LoRA adapter {name!r} has rank {spec.rank}, above --max-lora-rank {max_rank}; "
                           "restart with a larger --max-lora-rank")
    return spec


def _check_module(name: str, model: ModelConfig, layer: int, kind: str, a_shape, b_shape) -> int:
    """The module's rank, after checking its place and shapes against the base."""
    if not 0 <= layer < model.num_layers:
        raise AdapterError(f"LoRA adapter {name!r} adapts layer {layer}; the base model has {model.num_layers}")
    if kind in ("gate", "up", "gate_up", "down") and model.moe is not None and model.moe.is_sparse(layer):
        raise AdapterError(f"LoRA adapter {name!r} adapts layer {layer}'s MLP, which is a mixture of experts "
                           "here; adapters on experts are not supported")
    out, inp = expected_shapes(model, kind)
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != inp or b_shape[0] != out or a_shape[0] != b_shape[1]:
        raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {kind} has A {list(a_shape)} and B {list(b_shape)}, "
                           f"but the base model needs A [r, {inp}] and B [{out}, r]: it was trained for another model")
    if a_shape[0] < 1:
        raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {kind} has rank 0")
    return int(a_shape[0])


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _safetensors_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as exc:
        raise AdapterError(f"{path} is not a readable safetensors file: {exc}") from None
    header.pop("__metadata__", None)
    return header


def _peft_config(name: str, folder: Path) -> dict:
    cfg_path = folder / "adapter_config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {name!r}: cannot read {cfg_path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {cfg_path} is not a JSON object")
    refuse = [("peft_type", lambda v: v not in (None, "LORA"), "only LoRA adapters are served"),
              ("use_dora", bool, "DoRA adapters are not supported"),
              ("fan_in_fan_out", bool, "fan_in_fan_out (Conv1D bases) is not supported"),
              ("bias", lambda v: v not in (None, "none"), "adapters with trained biases are not supported"),
              ("modules_to_save", bool, "modules_to_save (fully trained modules) is not supported"),
              ("lora_bias", bool, "adapters with trained biases are not supported")]
    for key, bad, why in refuse:
        if key in cfg and bad(cfg[key]):
            raise AdapterError(f"LoRA adapter {name!r}: {key}={cfg[key]!r}: {why}")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise AdapterError(f"LoRA adapter {name!r}: adapter_config.json needs an integer r >= 1")
    return cfg


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key the module's name ends with (keys are
    regular expressions matched against the end of the name), else the default."""
    for key, value in (patterns or {}).items():
        if re.search(rf"(^|\.){key}$", module_name):
            return value
    return default


def _read_peft(name: str, folder: Path, model: ModelConfig) -> AdapterSpec:
    cfg = _peft_config(name, folder)
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        extra = " (adapter_model.bin: save it with safe_serialization=True)" \
            if (folder / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"LoRA adapter {name!r}: {weights} is missing{extra}")
    header = _safetensors_header(weights)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key, info in header.items():
        m = _PEFT_KEY.match(key)
        if m is None or m.group(2) not in _HF_KINDS:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key} adapts a module that is not served "
                               "(only q/k/v/o and gate/up/down projections of decoder layers)")
        if info.get("dtype") not in _FLOAT_DTYPES:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key} is {info.get('dtype')}; F32, F16 or BF16 only")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = key
    if not pairs:
        raise AdapterError(f"LoRA adapter {name!r}: {weights} holds no LoRA tensors")
    alpha = cfg.get("lora_alpha", cfg["r"])
    modules = []
    for (layer, hf), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {hf} lacks its lora_{'A' if 'A' not in ab else 'B'}")
        kind = _HF_KINDS[hf]
        rank = _check_module(name, model, layer, kind, header[ab["A"]]["shape"], header[ab["B"]]["shape"])
        module_name = f"model.layers.{layer}.{'self_attn' if kind in ('q', 'k', 'v', 'qkv', 'o') else 'mlp'}.{hf}"
        a = float(_pattern_value(cfg.get("alpha_pattern"), module_name, alpha))
        modules.append(ModuleLoRA(layer, kind, ab["A"], ab["B"], rank,
                                  a / (math.sqrt(rank) if cfg.get("use_rslora") else rank)))
    return AdapterSpec(name, str(folder), "peft", max(m.rank for m in modules),
                       tuple(sorted({m.kind for m in modules})), _file_digest(weights),
                       cfg.get("base_model_name_or_path"), str(weights), tuple(modules))


def _read_gguf(name: str, path: Path, model: ModelConfig) -> AdapterSpec:
    from gguf import GGUFReader  # numpy only

    from tessera.models.families import family

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct errors/OSError on a bad file
        raise AdapterError(f"LoRA adapter {name!r}: {path} is not a readable GGUF file: {exc}") from None

    def meta(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if meta("general.type") != "adapter" or meta("adapter.type") != "lora":
        raise AdapterError(f"LoRA adapter {name!r}: {path} is a GGUF but not a LoRA adapter "
                           f"(general.type {meta('general.type')!r}, adapter.type {meta('adapter.type')!r})")
    arch = meta("general.architecture")
    if arch is not None and arch != model.architecture:
        raise AdapterError(f"LoRA adapter {name!r} is for a {arch} model; the base is {model.architecture}")
    alpha = float(meta("adapter.lora.alpha") or 0.0)
    tensors = {t.name: t for t in reader.tensors}
    fam = family(model.architecture)
    fused = fam.fused_projections  # Phi-3's ffn_up holds gate and up
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key, t in tensors.items():
        m = _GGUF_KEY.match(key)
        kind = None if m is None else ("gate_up" if fused else "up") if m.group(2) == "ffn_up" \
            else _GGUF_KINDS.get(m.group(2))
        if m is None or kind is None:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key} adapts a module that is not served")
        if t.tensor_type.name not in _FLOAT_DTYPES:
            raise AdapterError(f"LoRA adapter {name!r}: tensor {key} is {t.tensor_type.name}; F32, F16 or BF16 only")
        pairs.setdefault((int(m.group(1)), kind), {})[m.group(3)] = key
    if not pairs:
        raise AdapterError(f"LoRA adapter {name!r}: {path} holds no LoRA tensors")
    modules = []
    for (layer, kind), ab in sorted(pairs.items()):
        if set(ab) != {"a", "b"}:
            raise AdapterError(f"LoRA adapter {name!r}: layer {layer} {kind} lacks its lora_{'a' if 'a' not in ab else 'b'}")
        # GGUF lists dimensions innermost first: lora_a is [in, r], lora_b [r, out] there.
        a_shape = [int(d) for d in reversed(tensors[ab["a"]].shape)]
        b_shape = [int(d) for d in reversed(tensors[ab["b"]].shape)]
        rank = _check_module(name, model, layer, kind, a_shape, b_shape)
        modules.append(ModuleLoRA(layer, kind, ab["a"], ab["b"], rank, alpha / rank if alpha else 1.0))
    return AdapterSpec(name, str(path), "gguf", max(m.rank for m in modules), tuple(sorted({m.kind for m in modules})),
                       _file_digest(path), None, str(path), tuple(modules),
                       gguf_permuted_qk=fam.gguf_permuted_qk)
