"""A tiny random Hugging Face model folder (llama or qwen2) with a real BPE tokenizer.

Fast tests run the whole engine on it in seconds; it exercises the same
safetensors loading path users take with their own folders.
"""
from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, this is a tiny model for tests",
    "continuous batching serves many requests at once",
    "paged attention stores keys and values in blocks",
    "prefix caching reuses the blocks of shared prompts",
    "caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f600 emoji and accents",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, max_positions: int = 256) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "bos_token": None, "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": max_positions}))
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  rms_norm_eps=1e-6, eos_token_id=tok.token_to_id("<|im_end|>"), tie_word_embeddings=False)
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper logits than the default init, so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.25)
    model.save_pretrained(path, safe_serialization=True)
    return path
