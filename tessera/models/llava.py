"""LLaVA-style vision-language models: the text family's decoder, a CLIP tower and a projector.

The decoder is the shared one (its family read from `text_config`), so every path a text model
takes (the C decode step, the quantized projections, LoRA) is unchanged; an image only changes
the embeddings its placeholder tokens get. `encode_images` turns a batch of processed pixels into
those embeddings, one row per placeholder; the runner calls it when a prefill chunk reaches an
image and hands the rows to `forward` as `embeds` (engine/worker/image_cache.py). The tower and
the projector keep dense weights in the compute dtype whatever --quantization says: they are a
small share of the weights and run once per image, not per token.
"""
from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import Tensor, nn

from tessera.config import ModelConfig
from tessera.layers import Linear, QuantConfig
from tessera.layers.weights import AnyWeight
from tessera.models.clip import CLIPVisionTower, hf_activation
from tessera.models.decoder import DecoderForCausalLM


class LlavaProjector(nn.Module):
    """`multi_modal_projector`: linear, activation, linear into the text model's hidden size."""

    def __init__(self, c: ModelConfig, quant: QuantConfig):
        super().__init__()
        v = c.vision
        assert v is not None
        self.linear_1 = Linear(v.hidden_size, v.text_hidden_size, quant, bias=v.projector_bias,
                               prefix="multi_modal_projector.linear_1")
        self.linear_2 = Linear(v.text_hidden_size, v.text_hidden_size, quant, bias=v.projector_bias,
                               prefix="multi_modal_projector.linear_2")
        self.act = hf_activation(v.projector_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(DecoderForCausalLM):
    """A decoder whose prompts may hold images (ModelConfig.vision)."""

    def __init__(self, config: ModelConfig, quant: QuantConfig):
        super().__init__(config, quant)
        assert config.vision is not None
        dense = QuantConfig("none", quant.dtype, int8_activations=False)
        self.vision_tower = CLIPVisionTower(config.vision, dense)
        self.multi_modal_projector = LlavaProjector(config, dense)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
                     source: str = "checkpoint") -> None:
        super().load_weights(self.vision_tower.route(weights), source)

    def encode_images(self, pixels: Tensor) -> Tensor:
        """Processed pixels [B, C, H, W] -> the placeholder tokens' embeddings [B, tokens, hidden]."""
        v = self.config.vision
        assert v is not None
        features = self.vision_tower(pixels.to(self.dtype))
        if v.select_strategy == "default":  # the class token's state is not an image feature
            features = features[:, 1:]
        b, t, d = features.shape
        return self.multi_modal_projector(features.reshape(b * t, d)).view(b, t, -1)
