"""What a vision-language model's image side is, without torch: its encoder's shape, how its
processor prepares pixels, and an image as a request carries it to the engine.

The API process reads all of this from config.json and preprocessor_config.json (it never imports
torch) and prepares each image's pixels there; the engine receives them as plain bytes with their
shape (`ImageInput`) and runs the encoder when a prompt's prefill reaches the image's placeholder
tokens (engine/worker/image_cache.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from tessera.errors import ModelFormatError

# CLIPImageProcessor's defaults (OpenAI CLIP's statistics), for folders whose processor file omits them.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# CLIPVisionConfig's defaults: transformers writes only the fields that differ from them.
_CLIP_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                         "num_attention_heads": 12, "image_size": 224, "patch_size": 32, "layer_norm_eps": 1e-5,
                         "hidden_act": "quick_gelu", "num_channels": 3}


@dataclass(frozen=True)
class ImageProcessing:
    """CLIPImageProcessor's rules: resize the shortest edge (bicubic), center crop, rescale, normalize."""

    shortest_edge: int
    crop_height: int
    crop_width: int
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    resample: int = 3  # PIL's BICUBIC

    def __post_init__(self) -> None:
        if min(self.shortest_edge, self.crop_height, self.crop_width) <= 0:
            raise ModelFormatError("preprocessor_config.json gives a size or crop of zero")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or 0.0 in self.image_std:
            raise ModelFormatError("preprocessor_config.json needs three image_mean and three non-zero image_std")

    @classmethod
    def from_hf(cls, pp: dict[str, Any], image_size: int) -> "ImageProcessing":
        """From preprocessor_config.json (an empty dict: CLIPImageProcessor's defaults at the
        encoder's image size)."""
        size = pp.get("size", image_size)
        edge = size.get("shortest_edge", size.get("height")) if isinstance(size, dict) else size
        crop = pp.get("crop_size", image_size)
        ch, cw = (crop.get("height"), crop.get("width")) if isinstance(crop, dict) else (crop, crop)
        try:
            return cls(int(edge), int(ch), int(cw), bool(pp.get("do_resize", True)),
                       bool(pp.get("do_center_crop", True)), bool(pp.get("do_rescale", True)),
                       bool(pp.get("do_normalize", True)), float(pp.get("rescale_factor", 1 / 255)),
                       tuple(float(x) for x in pp.get("image_mean", CLIP_MEAN)),
                       tuple(float(x) for x in pp.get("image_std", CLIP_STD)), int(pp.get("resample", 3)))
        except (TypeError, ValueError) as exc:
            raise ModelFormatError(f"preprocessor_config.json has a bad value ({exc})") from None


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA-style image side: a CLIP vision tower, a two-layer projector into the text model's
    embeddings, and a placeholder token the prompt repeats once per image feature."""

    image_token_id: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    text_hidden_size: int
    processing: ImageProcessing
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    feature_layer: int = -2  # which hidden state feeds the projector (HF's index: 0 the embeddings)
    select_strategy: Literal["default", "full"] = "default"  # default drops the class token
    projector_act: str = "gelu"
    projector_bias: bool = True
    num_channels: int = 3

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ModelFormatError(f"image size {self.image_size} is not a multiple of patch size {self.patch_size}")
        if self.select_strategy not in ("default", "full"):
            raise ModelFormatError(f"vision_feature_select_strategy {self.select_strategy!r} is not supported")
        if not -self.num_layers - 1 <= self.feature_layer <= self.num_layers:
            raise ModelFormatError(f"vision_feature_layer {self.feature_layer} is outside the tower's "
                                   f"{self.num_layers} layers")
        if self.hidden_size % self.num_heads:
            raise ModelFormatError("the vision tower's hidden size is not a multiple of its heads")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and so prompt tokens) each image takes."""
        return self.num_patches + (self.select_strategy == "full")

    @property
    def layers_run(self) -> int:
        """Tower layers the selected hidden state needs (the later ones are never run)."""
        return self.feature_layer if self.feature_layer >= 0 else self.num_layers + 1 + self.feature_layer

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        return (self.num_channels, self.processing.crop_height, self.processing.crop_width)


def llava_vision_config(hf: dict[str, Any], text_hidden_size: int, folder: Optional[Path]) -> VisionConfig:
    """A `llava` config.json's image side, with its folder's preprocessor_config.json."""
    vc = {**_CLIP_VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if vc.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelFormatError(f"LLaVA with a {vc['model_type']!r} vision tower is not supported; Tessera runs CLIP's")
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ModelFormatError("LLaVA with several vision feature layers is not supported")
    token = hf.get("image_token_index", hf.get("image_token_id"))
    if token is None:
        raise ModelFormatError("config.json of a llava model lacks 'image_token_index'")
    pp: dict[str, Any] = {}
    path = folder / "preprocessor_config.json" if folder is not None else None
    if path is not None and path.is_file():
        try:
            pp = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFormatError(f"{path} is not valid JSON ({exc})") from None
    if pp.get("image_processor_type", "CLIPImageProcessor").removesuffix("Fast") != "CLIPImageProcessor":
        raise ModelFormatError(f"image processor {pp['image_processor_type']!r} is not supported; Tessera runs "
                               "CLIPImageProcessor's rules")
    size = int(vc["image_size"])
    try:
        return VisionConfig(
            image_token_id=int(token), hidden_size=int(vc["hidden_size"]),
            intermediate_size=int(vc["intermediate_size"]), num_layers=int(vc["num_hidden_layers"]),
            num_heads=int(vc["num_attention_heads"]), image_size=size, patch_size=int(vc["patch_size"]),
            text_hidden_size=text_hidden_size, processing=ImageProcessing.from_hf(pp, size),
            layer_norm_eps=float(vc["layer_norm_eps"]), hidden_act=str(vc["hidden_act"]), feature_layer=layer,
            select_strategy=hf.get("vision_feature_select_strategy", "default"),
            projector_act=str(hf.get("projector_hidden_act", "gelu")),
            projector_bias=bool(hf.get("multimodal_projector_bias", True)), num_channels=int(vc["num_channels"]))
    except (TypeError, ValueError) as exc:
        raise ModelFormatError(f"config.json of a llava model has a bad value ({exc})") from None


@dataclass
class ImageInput:
    """One image of a request as the engine takes it: the processor's float32 pixels (C order) as
    bytes with their shape, their content hash (the encoder cache's and the prefix cache's key),
    and the run of placeholder tokens it fills in the prompt."""

    hash: str
    pixels: bytes
    shape: tuple[int, ...]
    offset: int = 0  # the prompt index of its first placeholder token
    length: int = 0  # how many placeholder tokens it fills

    def overlaps(self, start: int, end: int) -> bool:
        """Whether prompt positions [start, end) hold some of its placeholders."""
        return self.offset < end and start < self.offset + self.length
