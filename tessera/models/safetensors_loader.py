"""Reading Hugging Face model folders: config.json into a ModelConfig, *.safetensors into weights.

Tensors keep their HF names (already the convention the model modules load),
except that multimodal Gemma 3 checkpoints have their language-model prefix
stripped so the text decoder sees the usual `model.layers.N...` names.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar, Union

from safetensors import SafetensorError, safe_open

from tessera.config import ModelConfig
from tessera.errors import ModelFormatError
from tessera.models.families import family_for_hf
from tessera.vision import llava_vision_config

if TYPE_CHECKING:
    import torch

    from tessera.layers.weights import GGUFWeight

_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelFormatError(f"{folder} has no config.json; pass a Hugging Face model folder or a .gguf file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{path} is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})") from None


# LlamaConfig's defaults: a llava config.json's text_config holds only the fields that differ.
_LLAMA_DEFAULTS = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                   "rms_norm_eps": 1e-6}


def config_from_hf(hf: dict[str, Any], name: str = "", folder: Optional[Path] = None) -> ModelConfig:
    """Network shape from an HF config.json dict: the fields every decoder has, then the family's
    own (tessera/models/families); a LLaVA's text model with its image side (`folder` holds its
    preprocessor_config.json)."""
    model_type = hf.get("model_type", "")
    if model_type == "llava":
        text = {**_LLAMA_DEFAULTS, **(hf.get("text_config") or {})}
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
            if key in hf:
                text.setdefault(key, hf[key])
        cfg = config_from_hf(text, name)
        cfg.vision = llava_vision_config(hf, cfg.hidden_size, folder)
        return cfg
    if model_type == "gemma3" and "text_config" in hf:  # multimodal wrapper: the text part is what we run
        text = dict(hf["text_config"])
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
        for key in ("bos_token_id", "eos_token_id"):
            text.setdefault(key, hf.get(key))
        hf = {**text, "model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type == "bert":
        return _bert_config(hf, name)
    fam = family_for_hf(model_type)
    try:
        cfg = _common_config(hf, fam.name, fam.tied_by_default, name)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"config.json lacks or has a bad value for {exc}; the model folder is incomplete") from None
    if fam.from_hf is not None:
        try:
            fam.from_hf(hf, cfg)
        except (TypeError, ValueError) as exc:
            raise ModelFormatError(f"config.json of a {fam.name} model has a bad value ({exc})") from None
    cfg.matryoshka = bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions"))
    return cfg


def _rope(hf: dict[str, Any]) -> tuple[float, Optional[dict[str, Any]]]:
    """RoPE base and scaling, from the older top-level keys or transformers 5's rope_parameters (of
    the full-attention layers where they are given per layer type)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        params = params["full_attention"]
    theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if (scaling.get("rope_type") or scaling.get("type")) == "default":
            scaling = None
    return float(theta), scaling


def _common_config(hf: dict[str, Any], arch: str, tied_by_default: bool, name: str) -> ModelConfig:
    hidden = int(hf["hidden_size"])
    num_heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    theta, scaling = _rope(hf)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", tied_by_default)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None],
        name=name,
        quantization=str(hf.get("torch_dtype") or hf.get("dtype") or ""),
    )


def _bert_config(hf: dict[str, Any], name: str) -> ModelConfig:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ModelFormatError("BERT models with relative position embeddings are not supported")
    try:
        cfg = _common_config(hf, "bert", False, name)
        cfg.type_vocab_size = int(hf.get("type_vocab_size", 2))
        cfg.layer_norm_eps = float(hf.get("layer_norm_eps", 1e-12))
        cfg.max_position_embeddings = int(hf.get("max_position_embeddings", 512))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"config.json lacks or has a bad value for {exc}; the model folder is incomplete") from None
    cfg.is_causal = False
    cfg.hidden_act = str(hf.get("hidden_act", "gelu"))
    cfg.matryoshka = bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions"))
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


_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


def _param_name(key: str, vision: bool = False) -> Optional[str]:
    """The model's parameter name of a checkpoint key: the language model's, and with `vision` the
    image side's (`vision_tower.`, `multi_modal_projector.`); None for parts not run."""
    part = key.removeprefix("model.")
    if part.startswith(_VISION_PARTS):  # transformers 4 wrote the tower's modules under `vision_model.`
        return part.replace("vision_tower.vision_model.", "vision_tower.", 1) if vision else None
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return rest if rest.startswith("lm_head.") else "model." + rest.removeprefix("model.")
    return key


def _read_all(folder: Path, read: Callable[[Any, str], T], vision: bool = False) -> Iterator[tuple[str, T]]:
    """(parameter name, read(open shard, key)) for every language-model tensor of the folder (and
    the image side's with `vision`)."""
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = _param_name(key, vision)
                    if name is not None:
                        yield name, read(f, key)
        except SafetensorError as exc:
            raise ModelFormatError(f"{path.name} is corrupt or truncated ({exc}); re-download the model") from None


def iter_safetensors_weights(folder: Path, vision: bool = False) -> Iterator[tuple[str, Union[torch.Tensor, GGUFWeight]]]:
    """Yield (HF name, float32 tensor) for every tensor of the folder's shards (the image side's
    too with `vision`); MXFP4 expert stacks (gpt-oss's `*_blocks` and `*_scales`) as their GGUF
    blocks, unchanged in value."""
    import torch

    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in _read_all(folder, lambda f, key: f.get_tensor(key), vision):
        base, _, part = name.rpartition("_")
        if t.dtype == torch.uint8 and part in ("blocks", "scales"):
            pair = pending.setdefault(base, {})
            pair[part] = t
            if len(pair) == 2:
                yield from _mxfp4_experts(base, pending.pop(base))
            continue
        yield name, t.float()
    if pending:
        raise ModelFormatError(f"{folder}: MXFP4 tensor {next(iter(pending))} lacks its blocks or scales")


def _mxfp4_experts(base: str, pair: dict[str, torch.Tensor]) -> Iterator[tuple[str, GGUFWeight]]:
    """gpt-oss's expert stacks: `gate_up_proj` (gate and up rows interleaved) and `down_proj`, as
    the stacked names models/decoder.py splits per expert."""
    from tessera.layers.weights import mxfp4_from_blocks

    blocks, scales = pair["blocks"].numpy(), pair["scales"].numpy()
    try:
        if base.endswith(".gate_up_proj"):
            stem = base.removesuffix("gate_up_proj")
            yield stem + "gate_proj.weight", mxfp4_from_blocks(blocks[:, 0::2], scales[:, 0::2])
            yield stem + "up_proj.weight", mxfp4_from_blocks(blocks[:, 1::2], scales[:, 1::2])
        else:
            yield base + ".weight", mxfp4_from_blocks(blocks, scales)
    except ValueError as exc:
        raise ModelFormatError(f"{base}: {exc}") from None


def safetensors_shapes(folder: Path) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, from the shards' headers only (no weight is read)."""
    return _read_all(folder, lambda f, key: tuple(f.get_slice(key).get_shape()))
