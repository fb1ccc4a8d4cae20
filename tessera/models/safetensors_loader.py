"""Reading Hugging Face model folders: config.json into a ModelConfig, *.safetensors into weights.

Tensors keep their HF names (already the convention the model modules load),
except that multimodal Gemma 3 checkpoints have their language-model prefix
stripped so the text decoder sees the usual `model.layers.N...` names.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

from safetensors import SafetensorError, safe_open

from tessera.config import ModelConfig
from tessera.errors import ModelFormatError

if TYPE_CHECKING:
    import torch

_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3",
                "bert": "bert"}
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{folder} has no config.json; pass a Hugging Face model folder or a .gguf file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{path} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None


def config_from_hf(hf: dict[str, Any], name: str = "") -> ModelConfig:
    """Network shape from an HF config.json dict."""
    model_type = hf.get("model_type", "")
    if model_type == "gemma3" and "text_config" in hf:  # multimodal wrapper: the text part is what we run
        text = dict(hf["text_config"])
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
        for key in ("bos_token_id", "eos_token_id"):
            text.setdefault(key, hf.get(key))
        hf = {**text, "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    arch = _MODEL_TYPES.get(model_type)
    if arch is None:
        raise ModelFormatError(
            f"model type {model_type or '(none)'!r} is not supported; Tessera runs llama, qwen2 and gemma3 models "
            "and BERT encoders"
        )
    try:
        hidden = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        rope_params = hf.get("rope_parameters") or {}
        if "full_attention" in rope_params:  # per-layer-type form (gemma3 in transformers 5)
            local = rope_params.get("sliding_attention", {})
            rope_params = rope_params["full_attention"]
        else:
            local = {}
        theta = hf.get("rope_theta") or rope_params.get("rope_theta") or (10000.0 if arch != "gemma3" else 1e6)
        scaling = hf.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            if (scaling.get("rope_type") or scaling.get("type")) == "default":
                scaling = None
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=arch == "qwen2",  # qwen2 always has a QKV bias; llama biases are refused below
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            quantization=str(hf.get("torch_dtype") or hf.get("dtype") or ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"config.json lacks or has a bad value for {exc}; the model folder is incomplete") from None
    cfg.matryoshka = bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions"))
    if arch == "bert":
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ModelFormatError("BERT models with relative position embeddings are not supported")
        cfg.is_causal = False
        cfg.type_vocab_size = int(hf.get("type_vocab_size", 2))
        cfg.layer_norm_eps = float(hf.get("layer_norm_eps", 1e-12))
        cfg.hidden_act = str(hf.get("hidden_act", "gelu"))
        cfg.max_position_embeddings = int(hf.get("max_position_embeddings", 512))
    if arch == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        raise ModelFormatError("llama models with attention or MLP biases are not supported")
    if arch == "qwen2" and hf.get("use_sliding_window"):
        raise ModelFormatError("qwen2 models with sliding-window attention are not supported")
    if arch == "gemma3":
        cfg.sliding_window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if layer_types and "full_attention" in layer_types:
            cfg.sliding_window_pattern = layer_types.index("full_attention") + 1
        else:
            cfg.sliding_window_pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        cfg.rope_local_base_freq = float(hf.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
        cfg.query_pre_attn_scalar = float(hf.get("query_pre_attn_scalar") or cfg.head_dim)
        cfg.final_logit_softcapping = hf.get("final_logit_softcapping")
        cfg.attn_logit_softcapping = hf.get("attn_logit_softcapping")
    return cfg


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelFormatError(f"{index} is not a valid safetensors index ({exc})") from None
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder} has no *.safetensors weights; Tessera needs safetensors or a .gguf file")
    for f in files:
        if not f.is_file():
            raise ModelFormatError(f"{folder} is missing weight shard {f.name}; re-download the model")
    return files


T = TypeVar("T")


def _param_name(key: str) -> Optional[str]:
    """The language model's parameter name of a checkpoint key; None for vision parts."""
    if key.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                       "model.multi_modal_projector.")):
        return None
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return rest if rest.startswith("lm_head.") else "model." + rest.removeprefix("model.")
    return key


def _read_all(folder: Path, read: Callable[[Any, str], T]) -> Iterator[tuple[str, T]]:
    """(parameter name, read(open shard, key)) for every language-model tensor of the folder."""
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = _param_name(key)
                    if name is not None:
                        yield name, read(f, key)
        except SafetensorError as exc:
            raise ModelFormatError(f"{path.name} is corrupt or truncated ({exc}); re-download the model") from None


def iter_safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor of the folder's shards."""
    return _read_all(folder, lambda f, key: f.get_tensor(key).float())


def safetensors_shapes(folder: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, from the shards' headers only (no weight is read)."""
    return _read_all(folder, lambda f, key: tuple(f.get_slice(key).get_shape()))
