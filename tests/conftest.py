"""Shared fixtures: real packaged models by registry name, and tiny random HF models.

The tiny models are written once per test session with transformers itself
(config + safetensors + a small trained byte-level BPE tokenizer with a chat
template), so tests can compare Tessera against Hugging Face in seconds.
"""
from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. The knob is read as
# kernels are decorated (triton.language's helpers at its import), so it is set before any test
# module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Where the real models were assembled before the registry existed; used only as a fallback.
_FALLBACK_FILES = {
    "smollm2-135m": "smollm2.gguf",
    "qwen2.5-coder-0.5b": "qwen05.gguf",
    "gemma3-270m": "gemma.gguf",
}

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 320  # model vocabulary; the tokenizer uses the first ~300 ids
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny tokenizer for tests.",
    "def add(a, b):\n    return a + b\n",
    "Grüße aus München, naïve café, 東京 and emoji 🙂🚀.",
    "the the the and and of of to to in in is is",
]


TORCH_THREADS = torch.get_num_threads()  # the machine's, before any test set it


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """torch's thread count is per process, and engines set it (`num_threads`; in-process replicas
    each take their share of the cores): without this, every test after one of those would run
    its torch work, transformers' oracle included, on fewer threads than the machine has."""
    yield
    if torch.get_num_threads() != TORCH_THREADS:
        torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(autouse=True, scope="module")
def _garbage_collected_per_module():
    """An engine and its model sit in reference cycles (parts holding the engine's bound methods),
    which only the cyclic collector frees, and its full passes come rarely in a process holding
    as many long-lived objects as a test session: without a collection between modules, the
    weights of every engine a module built stayed resident, and a full run on a 24 GiB host
    reached it and was killed."""
    yield
    gc.collect()


@pytest.fixture(scope="session")
def model_path() -> Callable[[str], Path]:
    """Resolve a registry model name to a local file, pulling it on first use."""

    def resolve(name: str) -> Path:
        try:
            from tessera.models.registry import ensure_model
        except ImportError:
            ensure_model = None
        if ensure_model is not None:
            return Path(ensure_model(name))
        path = Path("/tmp") / _FALLBACK_FILES.get(name, name)
        if not path.is_file():
            pytest.skip(f"model {name} is not available")
        return path

    return resolve


def build_tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE trained on a few lines, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        unk_token=None, chat_template=TINY_CHAT_TEMPLATE,
    )


def tiny_hf_config(kind: str, wide: bool = False):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    common = dict(vocab_size=TINY_VOCAB, hidden_size=256 if wide else 64, intermediate_size=512 if wide else 128,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=0, eos_token_id=2)
    if kind == "llama":
        return LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, rms_norm_eps=1e-5,
                           tie_word_embeddings=False, **common)
    if kind == "llama3-rope":
        return LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                            "rope_theta": 500000.0}, **common)
    if kind == "llama-linear-rope":
        return LlamaConfig(num_hidden_layers=2, num_key_value_heads=4, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, **common)
    if kind == "qwen2":
        return Qwen2Config(num_hidden_layers=2, num_key_value_heads=1, tie_word_embeddings=True, **common)
    if kind == "gemma3":
        return Gemma3TextConfig(
            num_hidden_layers=3, num_key_value_heads=1, head_dim=32, sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24, **common,
        )
    return _family_config(kind, common)


# The families beyond llama, qwen2 and gemma3, each tiny with GQA and its own features switched on
# (soft-caps that bite at these scales, LongRoPE past a short pretraining length, a NoPE layer).
TINY_FAMILIES = ("qwen3", "gemma2", "phi3", "olmo2", "granite", "smollm3")
# Mixture-of-experts families: 8 (4) experts, 2 per token; Qwen3-MoE with a dense layer between
# sparse ones, gpt-oss with a SwiGLU clamp that bites at this scale (7.0 in the real model) and a
# sliding window shorter than the prompts.
TINY_MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


def _family_config(kind: str, common: dict):
    from transformers import (Gemma2Config, GptOssConfig, GraniteConfig, MixtralConfig, Olmo2Config, Phi3Config,
                              Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

    if kind == "qwen3":  # head_dim 32 of a 64-wide model with 4 heads, as Qwen3-0.6B's 128 of 1,024 / 16
        return Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                           **common)
    if kind == "gemma2":
        return Gemma2Config(num_hidden_layers=3, num_key_value_heads=2, head_dim=32, sliding_window=6,
                            query_pre_attn_scalar=24, attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
                            **common)
    if kind == "phi3":
        # LongRoPE over a 512-token pretraining length stretched to 2,048 (its attention factor
        # 1.10), partial rotary: 8 of each head's 16 dimensions rotate.
        half = common["hidden_size"] // common["num_attention_heads"] // 4
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 512,
                "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + i for i in range(half)]}
        return Phi3Config(num_hidden_layers=2, num_key_value_heads=2, rope_parameters=rope, sliding_window=None,
                          original_max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=1,
                          **{**common, "max_position_embeddings": 2048})
    if kind == "olmo2":
        return Olmo2Config(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=1,
                           **common)
    if kind == "granite":
        return GraniteConfig(num_hidden_layers=2, num_key_value_heads=2, embedding_multiplier=3.0,
                             attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=0.5,
                             tie_word_embeddings=True, **common)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(num_hidden_layers=3, num_key_value_heads=2, head_dim=32, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=common["intermediate_size"] // 2,
                              norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False, **common)
    if kind == "mixtral":
        return MixtralConfig(num_hidden_layers=2, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                             tie_word_embeddings=False, **common)
    if kind == "gpt_oss":
        return GptOssConfig(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=6, swiglu_limit=0.5, tie_word_embeddings=False,
                            **{**common, "intermediate_size": common["hidden_size"]})
    if kind == "lfm2":
        # Conv layers first and between the attention ones, as in LFM2-1.2B (6 attention of 16);
        # kernel 3 as every released LFM2; the MLP width as its config derives it (192 -> 128).
        from transformers import Lfm2Config

        return Lfm2Config(num_hidden_layers=4, num_key_value_heads=2, conv_L_cache=3, block_multiple_of=32,
                          layer_types=["conv", "full_attention", "conv", "full_attention"], pad_token_id=1,
                          **{**common, "intermediate_size": 3 * common["intermediate_size"] // 2})
    if kind == "granitemoehybrid":
        # Granite 4.0-H's shape, dense: Mamba-2 layers around one attention layer (4 heads of 32
        # channels in 2 groups, a 16-value state, kernel 4), Granite's multipliers, RoPE.
        from transformers import GraniteMoeHybridConfig

        return GraniteMoeHybridConfig(
            num_hidden_layers=4, num_key_value_heads=2, num_local_experts=0, shared_intermediate_size=128,
            layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4, mamba_n_groups=2,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, position_embedding_type="rope",
            embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=0.5,
            pad_token_id=1, **common)
    if kind == "smollm3":  # 4 layers: the 4th has no RoPE
        return SmolLM3Config(num_hidden_layers=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=1,
                             **common)
    raise ValueError(kind)


def build_tiny_hf_model(kind: str, folder: Path, seed: int = 0, std: float = 0.08, wide: bool = False,
                        config=None):
    """Random HF model of `kind` saved (float32 safetensors + tokenizer) into `folder`; returns the model.
    `std`: the matrices' spread (larger: sharper logits, fewer near-ties between the top tokens).
    `wide`: hidden size 256 and MLP 512, rows long enough for Q4_K's 256-value blocks. `config`: a
    transformers config to use instead of the kind's tiny one."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config if config is not None else tiny_hf_config(kind, wide)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gemma = kind.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # gemma stores w of (1 + w); the others w itself
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(std * torch.randn_like(p))
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Callable[[str], Path]:
    """Factory: folder of a tiny random HF model of a kind (llama, llama3-rope, qwen2, gemma3, ...)."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            build_tiny_hf_model(kind, folder)
            made[kind] = folder
        return made[kind]

    return make
