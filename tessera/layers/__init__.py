"""The blocks models are made of: Linear with a quantization method, RMSNorm and LayerNorm,
rotary embedding, Attention (causal or bidirectional). Nothing here imports the engine."""
from tessera.layers.attention import Attention
from tessera.layers.linear import Linear, VocabEmbedding
from tessera.layers.mlp import GatedMLP
from tessera.layers.norm import LayerNorm, RMSNorm
from tessera.layers.quantization import QUANTIZATION_MODES, QuantConfig, QuantizationMode
from tessera.layers.rotary import RotaryEmbedding, apply_rope, rope_inv_freq
from tessera.layers.weights import FloatWeight, GGUFWeight

__all__ = ["Attention", "GatedMLP", "Linear", "VocabEmbedding", "LayerNorm", "RMSNorm", "QuantConfig", "QuantizationMode",
           "QUANTIZATION_MODES", "RotaryEmbedding", "apply_rope", "rope_inv_freq", "FloatWeight", "GGUFWeight"]
