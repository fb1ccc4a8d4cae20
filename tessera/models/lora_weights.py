"""LoRA adapters' values, laid out for the slots of layers/lora.py, and a model's adapted layers.

An adapter checked by models/adapters.py is loaded here into one (At, Bt) pair per adapted
projection, in the adapters' dtype (--lora-dtype), both transposed as kernels/lora.c reads them:
At [in, P * R] holds each part's A (Q, K, V or gate, up) at columns p * R, Bt [R, out] each part's
B columns scaled by the module's alpha / r, R being the
adapter's largest rank; modules of smaller rank (PEFT's rank_pattern) and parts the adapter
leaves alone are zeros, which add nothing. A fused target (Phi-3's qkv_proj) repeats its one A in
every part.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from tessera.config import ModelConfig
from tessera.errors import AdapterError
from tessera.layers.linear import Linear
from tessera.layers.lora import LoRASlots, LoRATable
from tessera.models.adapters import LINEAR_PARTS, TARGETS, AdapterSpec, expected_shapes
from tessera.models.gguf_loader import _unpermute_qk


@dataclass
class LoRAWeights:
    """An adapter's tensors by projection (`model.layers.N.<LINEAR_PARTS key>`)."""

    spec: AdapterSpec
    rank: int
    tables: dict[str, tuple[Tensor, Tensor]]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.tables.values())


def _read_tensors(spec: AdapterSpec) -> dict[str, Tensor]:
    names = {n for m in spec.modules for n in (m.a, m.b)}
    try:
        if spec.format == "peft":
            from safetensors import safe_open

            with safe_open(spec.weights_file, framework="pt") as f:
                return {n: f.get_tensor(n).float() for n in names}
        from gguf import GGMLQuantizationType, GGUFReader

        out = {}
        for t in GGUFReader(spec.weights_file).tensors:
            if t.name in names:
                data = np.array(t.data)
                if t.tensor_type == GGMLQuantizationType.BF16:
                    out[t.name] = torch.from_numpy(data.view(np.uint16).astype(np.int16)).view(torch.bfloat16).float()
                else:
                    out[t.name] = torch.from_numpy(data.astype(np.float32))
        return out
    except (OSError, ValueError, KeyError) as exc:
        raise AdapterError(f"LoRA adapter {spec.name!r}: cannot read {spec.weights_file}: {exc}") from None


def load_lora_weights(spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype, device: str = "cpu") -> LoRAWeights:
    """The adapter's values for the slots, in `dtype`; raises AdapterError if the file changed
    since it was checked in a way that no longer fits."""
    tensors = _read_tensors(spec)
    rank = spec.rank
    built: dict[str, tuple[Tensor, Tensor]] = {}
    for m in spec.modules:
        linear, parts = TARGETS[m.kind]
        all_parts = LINEAR_PARTS[linear]
        sizes = [expected_shapes(model, p)[0] for p in all_parts]
        in_size = expected_shapes(model, all_parts[0])[1]
        prefix = f"model.layers.{m.layer}.{linear}"
        a_cat, b_cat = built.get(prefix) or (torch.zeros(len(all_parts) * rank, in_size),
                                             torch.zeros(sum(sizes), rank))
        a, b = tensors[m.a], tensors[m.b]
        if tuple(a.shape) != (m.rank, in_size) or b.shape[1] != m.rank:
            raise AdapterError(f"LoRA adapter {spec.name!r}: {m.a} or {m.b} changed shape since it was checked")
        if spec.gguf_permuted_qk and m.kind in ("q", "k"):
            heads = model.num_heads if m.kind == "q" else model.num_kv_heads
            b = b[torch.from_numpy(_unpermute_qk(np.arange(b.shape[0]), heads))]
        row = 0
        for p in parts:
            i = all_parts.index(p)
            start, size = sum(sizes[:i]), sizes[i]
            a_cat[i * rank:i * rank + m.rank] = a
            b_cat[start:start + size, :m.rank] = b[row:row + size] * m.scale
            row += size
        built[prefix] = (a_cat, b_cat)
    tables = {k: (a.t().to(device, dtype).contiguous(), b.t().to(device, dtype).contiguous())
              for k, (a, b) in built.items()}
    return LoRAWeights(spec, rank, tables)


class LoRAModel:
    """A model's adapted projections (every q/k/v/o and gate/up/down Linear of its decoder
    layers, experts aside) and its slots; `assign` puts an adapter's weights in a slot."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.slots = LoRASlots(max_loras, max_rank, device, dtype)
        self.tables: dict[str, LoRATable] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and any(name.endswith("." + k) for k in LINEAR_PARTS) \
                    and ".experts." not in name:
                module.lora = LoRATable(self.slots, module.output_sizes)
                self.tables[name] = module.lora

    def assign(self, slot: int, weights: LoRAWeights | None) -> None:
        """Slot `slot` serves `weights` (None: it is emptied)."""
        if weights is not None:
            missing = [k for k in weights.tables if k not in self.tables]
            if missing:
                raise AdapterError(f"LoRA adapter {weights.spec.name!r} adapts {missing[0]}, which this model "
                                   "does not adapt")
        for name, table in self.tables.items():
            table.put(slot, None if weights is None else weights.tables.get(name))
        self.slots.ranks[slot] = 0 if weights is None else weights.rank
