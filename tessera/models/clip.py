"""CLIP's vision transformer (the tower of LLaVA-style models), built from tessera.layers.

Module names follow Hugging Face's CLIPVisionTransformer under `vision_tower`, with Q/K/V
fused into one Linear as in the decoder. The patch convolution (a kernel the size of its stride)
is a Linear over each patch's flattened pixels, which is the same product without a convolution
kernel. Only the layers up to the hidden state a model selects are built and run: LLaVA reads
the second-to-last layer's output, so the last layer would be work thrown away.
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tessera.errors import ModelFormatError
from tessera.layers import LayerNorm, Linear, QuantConfig, VocabEmbedding
from tessera.layers.weights import AnyWeight
from tessera.models.weights import as_float_tensor
from tessera.vision import VisionConfig


def hf_activation(name: str):
    """Hugging Face's activation by its config name (ACT2FN), for the ones vision towers use."""
    table = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
             "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
             "gelu_new": lambda x: F.gelu(x, approximate="tanh")}
    if name not in table:
        raise ModelFormatError(f"activation {name!r} of the vision side is not supported; Tessera runs "
                               f"{', '.join(table)}")
    return table[name]


def _rows(layer: Linear, x: Tensor) -> Tensor:
    """A Linear over the last dimension of a batch of images' tokens."""
    return layer(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], layer.output_size)


class CLIPEmbeddings(nn.Module):
    def __init__(self, v: VisionConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.patch = v.patch_size
        self.patch_embedding = Linear(v.num_channels * v.patch_size ** 2, v.hidden_size, quant,
                                      prefix=prefix + ".patch_embedding")
        self.position_embedding = VocabEmbedding(v.num_patches + 1, v.hidden_size, quant,
                                                 prefix=prefix + ".position_embedding")
        self.register_buffer("class_embedding", None, persistent=False)  # [hidden], set by load

    def forward(self, pixels: Tensor) -> Tensor:
        b, c, h, w = pixels.shape
        p = self.patch
        patches = pixels.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        x = _rows(self.patch_embedding, patches)
        x = torch.cat([self.class_embedding.to(x.dtype).expand(b, 1, -1), x], dim=1)
        return x + self.position_embedding.embed(torch.arange(x.shape[1], device=x.device))


class CLIPAttention(nn.Module):
    def __init__(self, v: VisionConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.num_heads, self.head_dim = v.num_heads, v.hidden_size // v.num_heads
        self.qkv_proj = Linear(v.hidden_size, [v.hidden_size] * 3, quant, bias=True, shard_names=["q", "k", "v"],
                               prefix=prefix + ".qkv_proj")
        self.out_proj = Linear(v.hidden_size, v.hidden_size, quant, bias=True, prefix=prefix + ".out_proj")

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = _rows(self.qkv_proj, x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=1.0 / math.sqrt(self.head_dim))
        return _rows(self.out_proj, out.transpose(1, 2).reshape(b, t, -1))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, v: VisionConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.self_attn = CLIPAttention(v, quant, prefix + ".self_attn")
        self.layer_norm1 = LayerNorm(v.hidden_size, v.layer_norm_eps, quant.dtype, prefix + ".layer_norm1")
        self.layer_norm2 = LayerNorm(v.hidden_size, v.layer_norm_eps, quant.dtype, prefix + ".layer_norm2")
        self.mlp = nn.Module()
        self.mlp.fc1 = Linear(v.hidden_size, v.intermediate_size, quant, bias=True, prefix=prefix + ".mlp.fc1")
        self.mlp.fc2 = Linear(v.intermediate_size, v.hidden_size, quant, bias=True, prefix=prefix + ".mlp.fc2")
        self.act = hf_activation(v.hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + _rows(self.mlp.fc2, self.act(_rows(self.mlp.fc1, self.layer_norm2(x))))


class CLIPVisionTower(nn.Module):
    """`vision_tower`: pixels [B, C, H, W] in, the selected hidden state [B, patches + 1, hidden] out.
    (Checkpoints written before transformers 5 have a `vision_model.` level the loader drops.)"""

    PREFIX = "vision_tower"

    def __init__(self, v: VisionConfig, quant: QuantConfig):
        super().__init__()
        self.config = v
        p = self.PREFIX
        self.embeddings = CLIPEmbeddings(v, quant, p + ".embeddings")
        self.pre_layrnorm = LayerNorm(v.hidden_size, v.layer_norm_eps, quant.dtype, p + ".pre_layrnorm")
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(CLIPEncoderLayer(v, quant, f"{p}.encoder.layers.{i}")
                                            for i in range(v.layers_run))

    def forward(self, pixels: Tensor) -> Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x

    def route(self, weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]]
              ) -> Iterator[tuple[str, Union[Tensor, AnyWeight]]]:
        """The checkpoint's tensors with the tower's made loadable: the patch convolution as its
        Linear, the class embedding kept here, the layers past the selected one and the final norm
        (which no selected state passes through) dropped; every other tensor passes through."""
        p = self.PREFIX
        for name, w in weights:
            if not name.startswith(p + "."):
                yield name, w
                continue
            rest = name[len(p) + 1:]
            if rest == "embeddings.class_embedding":
                self.embeddings.class_embedding = as_float_tensor(w).float()
            elif rest == "embeddings.patch_embedding.weight":
                t = as_float_tensor(w)
                yield name, t.reshape(t.shape[0], -1)
            elif rest.startswith("post_layernorm.") or rest == "embeddings.position_ids":
                continue
            elif rest.startswith("encoder.layers.") and int(rest.split(".")[2]) >= self.config.layers_run:
                continue
            else:
                yield name, w
        if self.embeddings.class_embedding is None:
            raise ModelFormatError(f"the checkpoint lacks {p}.embeddings.class_embedding")
