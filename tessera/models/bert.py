"""BERT encoder (sentence-transformers' all-MiniLM and kin) built from tessera.layers.

An encoder differs from the decoders in four places, each a layer's choice rather than an
engine special case: attention is bidirectional (`Attention(causal=False)`: every token sees
its whole input, and no KV cache is kept, because nothing is generated after the one
forward), positions are learned absolute embeddings added to the tokens' (plus the token-type
embedding, segment 0 for single texts, as sentence-transformers feeds), the MLP is
dense -> GELU -> dense, and the norms are LayerNorms after each residual add (post-norm).
Module names follow Hugging Face's BertModel, with query/key/value fused into one `qkv`
Linear. There is no LM head: the engine pools the final hidden states (engine/worker/runner.py).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from tessera.attention.base import AttentionMetadata
from tessera.config import ModelConfig
from tessera.errors import ModelFormatError
from tessera.layers import Attention, LayerNorm, Linear, QuantConfig, VocabEmbedding
from tessera.layers.quantization import Activation
from tessera.layers.weights import AnyWeight
from tessera.models.base import ExecutionPath, ModelBase
from tessera.models.weights import load_named_weights

PACKED_MODULES = {"query": ("qkv", "q"), "key": ("qkv", "k"), "value": ("qkv", "v")}
# Hugging Face's names for the activation (ACT2FN): exact erf GELU, or its tanh approximation.
_GELU: dict[str, Activation] = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                                "gelu_fast": "gelu_tanh"}


def gelu_activation(hidden_act: str) -> Activation:
    if hidden_act not in _GELU:
        raise ModelFormatError(f"BERT activation {hidden_act!r} is not supported; Tessera runs {', '.join(_GELU)}")
    return _GELU[hidden_act]


class BertEmbeddings(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig):
        super().__init__()
        self.word_embeddings = VocabEmbedding(c.vocab_size, c.hidden_size, quant, prefix="embeddings.word_embeddings")
        self.position_embeddings = VocabEmbedding(c.max_position_embeddings, c.hidden_size, quant,
                                                  prefix="embeddings.position_embeddings")
        self.token_type_embeddings = VocabEmbedding(max(1, c.type_vocab_size), c.hidden_size, quant,
                                                    prefix="embeddings.token_type_embeddings")
        self.LayerNorm = LayerNorm(c.hidden_size, c.layer_norm_eps, quant.dtype, prefix="embeddings.LayerNorm")

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        segment = self.token_type_embeddings.embed(torch.zeros(1, dtype=torch.long))  # every token is segment 0
        x = self.word_embeddings.embed(input_ids) + self.position_embeddings.embed(positions)
        return self.LayerNorm(x, segment)


class BertSelfAttention(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        size = c.num_heads * c.head_dim
        self.qkv = Linear(c.hidden_size, [size] * 3, quant, bias=True, shard_names=["q", "k", "v"],
                          prefix=prefix + ".qkv")
        self.attn = Attention(c.num_heads, c.head_dim, 1.0 / math.sqrt(c.head_dim), c.num_heads, causal=False)

    def forward(self, h: Tensor, meta: AttentionMetadata) -> Tensor:
        t, n, d = h.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv(h).view(t, 3, n, d)
        return self.attn(qkv[:, 0], qkv[:, 1], qkv[:, 2], None, meta)


class BertDenseNorm(nn.Module):
    """BERT's `output` blocks: dense, then LayerNorm of it plus the residual."""

    def __init__(self, c: ModelConfig, quant: QuantConfig, input_size: int, prefix: str):
        super().__init__()
        self.dense = Linear(input_size, c.hidden_size, quant, bias=True, prefix=prefix + ".dense")
        self.LayerNorm = LayerNorm(c.hidden_size, c.layer_norm_eps, quant.dtype, prefix=prefix + ".LayerNorm")

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        return self.LayerNorm(self.dense(x, residual=residual))  # the add done by the product (oneDNN post-op)


class BertAttention(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.add_module("self", BertSelfAttention(c, quant, prefix + ".self"))  # HF's name for it
        self.output = BertDenseNorm(c, quant, c.num_heads * c.head_dim, prefix + ".output")

    def forward(self, h: Tensor, meta: AttentionMetadata) -> Tensor:
        return self.output(self.get_submodule("self")(h, meta), h)


class BertIntermediate(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.dense = Linear(c.hidden_size, c.intermediate_size, quant, bias=True, prefix=prefix + ".dense")
        self.activation = gelu_activation(c.hidden_act or "gelu")

    def forward(self, h: Tensor) -> Tensor:
        return self.dense(h, self.activation)  # the GELU applied by the product (layers/quantization/base.py, dense_linear)


class BertLayer(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig, prefix: str):
        super().__init__()
        self.attention = BertAttention(c, quant, prefix + ".attention")
        self.intermediate = BertIntermediate(c, quant, prefix + ".intermediate")
        self.output = BertDenseNorm(c, quant, c.intermediate_size, prefix + ".output")

    def forward(self, h: Tensor, meta: AttentionMetadata) -> Tensor:
        h = self.attention(h, meta)
        return self.output(self.intermediate(h), h)


class BertEncoder(nn.Module):
    def __init__(self, c: ModelConfig, quant: QuantConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(c, quant, f"encoder.layer.{i}") for i in range(c.num_layers))


class BertModel(nn.Module, ModelBase):
    """The encoder over a packed batch of whole inputs; returns the final hidden states, one row
    per token (the engine pools them). `kv_caches` is accepted for the engine's model interface
    and unused: nothing is cached."""

    def __init__(self, config: ModelConfig, quant: QuantConfig):
        super().__init__()
        self.config = config
        self.dtype = quant.dtype
        self.embeddings = BertEmbeddings(config, quant)
        self.encoder = BertEncoder(config, quant)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Union[Tensor, AnyWeight]]],
                     source: str = "checkpoint") -> None:
        # BertFor* checkpoints put the encoder under "bert."; the pooler's dense layer (next-sentence
        # head) and the position-id buffer are not used by sentence embeddings.
        renamed = ((name.removeprefix("bert."), t) for name, t in weights)
        load_named_weights(self, renamed, source, extra={}, packed=PACKED_MODULES)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Optional[Tensor]],
                attn_meta: AttentionMetadata, layers: Optional[Sequence[int]] = None) -> Tensor:
        h = self.embeddings(input_ids, positions)
        for i in (range(len(self.encoder.layer)) if layers is None else layers):
            h = self.encoder.layer[i](h, attn_meta.for_layer(i))
        return h

    def execution_paths(self) -> frozenset[ExecutionPath]:
        """The modules only: an encoder computes each input whole, in one step, with no decode."""
        return frozenset({ExecutionPath.MODULES})
