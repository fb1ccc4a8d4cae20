"""Granite 4.0-H (transformers' GraniteMoeHybridForCausalLM): Granite's multipliers over layers that
are either attention (RoPE or none, per `position_embedding_type`) or a Mamba-2 mixer
(layers/mamba2.py) with per-request state in the engine's state slots; each layer's feed-forward is
its `shared_mlp` (SwiGLU, gate and up fused as `input_linear`). The mixture-of-experts variants
(`num_local_experts` > 0: 4.0-H-Tiny, -Small) are refused; the dense hybrids (4.0-H-Micro, 1B, 350M)
run."""
from __future__ import annotations

from typing import Any

from tessera.config import MambaConfig, ModelConfig
from tessera.errors import ModelFormatError
from tessera.models.families.base import Family, GGUFMetadata, need, refuse_biases

RENAMES = ((".shared_mlp.input_linear.", ".mlp.gate_up_proj."), (".shared_mlp.output_linear.", ".mlp.down_proj."))
_MAMBA = ("mamba", "linear_attention")
_ATTENTION = ("attention", "full_attention")


def _number(value: Any) -> float:
    """A float of config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


def _from_hf(hf: dict[str, Any], cfg: ModelConfig) -> None:
    family = "granitemoehybrid"
    refuse_biases(hf, family)
    if int(hf.get("num_local_experts") or 0) > 0:
        raise ModelFormatError(f"{family} models with experts (num_local_experts > 0) are not supported; "
                               "the dense hybrids (num_local_experts 0) are")
    kinds = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * cfg.num_layers
    if len(kinds) != cfg.num_layers or not set(kinds) <= {*_MAMBA, *_ATTENTION}:
        raise ModelFormatError(f"a {family} model's layer types {kinds} are not {cfg.num_layers} of mamba / attention")
    cfg.layer_kinds = ["mamba" if k in _MAMBA else "attention" for k in kinds]
    cfg.embedding_multiplier = float(need(hf, "embedding_multiplier", family))
    cfg.attention_multiplier = float(need(hf, "attention_multiplier", family))
    cfg.residual_multiplier = float(need(hf, "residual_multiplier", family))
    cfg.logits_scaling = float(need(hf, "logits_scaling", family))
    cfg.intermediate_size = int(need(hf, "shared_intermediate_size", family))
    if hf.get("position_embedding_type") != "rope":
        cfg.nope_layers = list(range(cfg.num_layers))
    heads = int(need(hf, "mamba_n_heads", family))
    inner = int(hf.get("mamba_expand", 2)) * cfg.hidden_size
    head_dim = hf.get("mamba_d_head", "auto")
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
    cfg.mamba = MambaConfig(heads=heads, head_dim=inner // heads if head_dim in (None, "auto") else int(head_dim),
                            d_state=int(need(hf, "mamba_d_state", family)), groups=int(hf.get("mamba_n_groups", 1)),
                            conv_kernel=int(hf.get("mamba_d_conv", 4)), inner=inner,
                            conv_bias=bool(hf.get("mamba_conv_bias", True)),
                            proj_bias=bool(hf.get("mamba_proj_bias", False)),
                            dt_min=_number(limit[0]), dt_max=_number(limit[1]))


def _from_gguf(gf: GGUFMetadata, cfg: ModelConfig) -> None:
    raise ModelFormatError("granitehybrid GGUF files are not read (their Mamba-2 tensors have no mapping here); "
                           "serve the model's Hugging Face folder")


FAMILY = Family(
    name="granitehybrid", hf_model_types=("granitemoehybrid",), from_hf=_from_hf, from_gguf=_from_gguf,
    renames=RENAMES, fused_projections=True, recurrent=True,
    summary="Granite's multipliers; most layers Mamba-2 with per-request state; no RoPE unless configured",
)
