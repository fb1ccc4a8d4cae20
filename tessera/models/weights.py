"""Routing checkpoint tensors (HF names) to the layers' weight loaders.

Models are built from tessera.layers with Hugging Face module names, plus a
packed-module map for the fused projections (q/k/v -> qkv_proj, gate/up ->
gate_up_proj), as nano-vllm and vLLM do. Loading is then one loop: find the
module a tensor belongs to, hand the tensor to its loader. Tensors are
streamed: a merged Linear stores its weight as soon as its last shard arrives,
so dequantized or raw copies never pile up.
"""
from __future__ import annotations

import logging
from typing import Iterable, Optional, Union

from torch import Tensor, nn

from tessera.errors import ModelFormatError
from tessera.layers.linear import Linear
from tessera.layers.norm import LayerNorm, RMSNorm
from tessera.layers.weights import AnyWeight

logger = logging.getLogger(__name__)

PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
                       source: str, extra: Optional[dict[str, Tensor]] = None,
                       packed: Optional[dict[str, tuple[str, str]]] = None) -> None:
    """Give each (HF name, tensor) to its module's loader; raise if any layer stays empty.

    Names that are not module weights (e.g. a GGUF's `rope_freqs`) are collected in `extra`.
    `packed`: the model's own packed-module map (BERT's query/key/value), else the decoders'.
    """
    packed = PACKED_MODULES if packed is None else packed
    for name, tensor in weights:
        module_path, _, kind = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        shard = None
        if leaf in packed:
            leaf, shard = packed[leaf]
            module_path = f"{parent}.{leaf}" if parent else leaf
        try:
            module = model.get_submodule(module_path)
        except AttributeError:
            if extra is not None:
                extra[name] = tensor
            else:
                logger.debug("ignoring tensor %s of %s (not used by this model)", name, source)
            continue
        if isinstance(module, Linear) and kind == "weight":
            module.weight_loader(tensor, shard)
        elif isinstance(module, Linear) and kind == "bias":
            module.bias_loader(tensor.float() if isinstance(tensor, Tensor) else tensor.dequantize(), shard)
        elif isinstance(module, (RMSNorm, LayerNorm)) and kind == "weight":
            module.weight_loader(tensor if isinstance(tensor, Tensor) else tensor.dequantize())
        elif isinstance(module, LayerNorm) and kind == "bias":
            module.bias_loader(tensor if isinstance(tensor, Tensor) else tensor.dequantize())
        elif extra is not None:
            extra[name] = tensor
    missing = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) and not m.loaded:
            missing += [_checkpoint_name(name, part) + ".weight" for part in m.missing_parts()] or [name + ".bias"]
        elif isinstance(m, (RMSNorm, LayerNorm)) and m.weight.is_meta:
            missing.append(name + ".weight")
        elif isinstance(m, LayerNorm) and m.bias.is_meta:
            missing.append(name + ".bias")
    if missing:
        raise ModelFormatError(
            f"{source} is missing {len(missing)} weight(s), e.g. {missing[0]}; the file is incomplete or "
            "not a standard checkpoint")


_UNPACKED = {packed: original for original, packed in PACKED_MODULES.items()}


def _checkpoint_name(module_name: str, part: str) -> str:
    """HF name of one part of a (possibly merged) module: gate_up_proj + up -> up_proj."""
    parent, _, leaf = module_name.rpartition(".")
    original = _UNPACKED.get((leaf, part))
    return f"{parent}.{original}" if original else module_name


def describe_quantization(model: nn.Module) -> list[str]:
    """One line per kind of Linear: what its weights became and their bytes (for the start-up log)."""
    counts: dict[str, list[int]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.quant_method is not None:
            key = f"{name.split('.')[-1]}: {m.quant_method.describe(m)}"
            entry = counts.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += m.quant_method.nbytes(m)
    return [f"{k} x{n} ({b / 2**20:.1f} MiB)" for k, (n, b) in sorted(counts.items())]


def as_float_tensor(t: Union[Tensor, AnyWeight]) -> Tensor:
    return t if isinstance(t, Tensor) else t.dequantize()


__all__ = ["PACKED_MODULES", "load_named_weights", "describe_quantization", "as_float_tensor"]
