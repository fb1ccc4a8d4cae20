"""A tiny random Hugging Face model folder (llama or qwen2) with a real BPE tokenizer.

Fast tests run the whole engine on it in seconds; it exercises the same
safetensors loading path users take with their own folders.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

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


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, max_positions: int = 256,
                    shape: Optional[dict] = None, std: float = 0.25) -> Path:
    """`shape`: config fields over the tiny ones (a real model's sizes, for benchmarks/gpu_check.py;
    a vocabulary larger than the tokenizer's is fine: the ids past it decode to nothing). `std`:
    the weights' spread (0.25 makes sharp logits at tiny sizes; real sizes want the usual 0.02)."""
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
    common.update(shape or {})
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper logits than the default init, so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_bert(path: Path, pooling: str = "mean", max_seq_length: int = 24, seed: int = 0,
                   matryoshka: bool = False) -> Path:
    """A tiny random BERT in sentence-transformers' layout (modules.json, 1_Pooling, Normalize,
    sentence_bert_config.json) with a WordPiece tokenizer, so sentence-transformers itself can
    load it as the oracle."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials,
                                                              show_progress=False))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok.enable_truncation(8)  # stored settings a loader must not apply to every encode (all-MiniLM's has them)
    tok.enable_padding(length=16)
    BertTokenizerFast(tokenizer_object=tok, model_max_length=128).save_pretrained(path)
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, type_vocab_size=2)
    if matryoshka:
        config.matryoshka_dimensions = [64, 32, 16]
    torch.manual_seed(seed)
    model = BertModel(config, add_pooling_layer=True).eval()
    model.save_pretrained(path, safe_serialization=True)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                "do_lower_case": False}))
    return path


# A PEFT adapter's module names by Tessera's projection kinds.
HF = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
      "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def write_peft(folder: Path, config, rank: int, seed: int, kinds=tuple(HF), scale_b: float = 0.3, **cfg) -> str:
    """A PEFT adapter folder of random A and B for a model of `config` (its layers' shapes), on the
    projections `kinds`; `cfg`: more adapter_config.json fields. Returns the folder."""
    import torch
    from safetensors.torch import save_file

    from tessera.models.adapters import expected_shapes

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for kind in kinds:
            out, inp = expected_shapes(config, kind)
            key = f"base_model.model.model.layers.{layer}.{HF[kind]}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * scale_b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                            "target_modules": [HF[k].split(".")[1] for k in kinds],
                                                            **cfg}))
    return str(folder)


# The tiny LLaVA's template: content parts as LLaVA's own templates read them, the image token
# where an image part is.
LLAVA_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_llava(path: Path, seed: int = 0, max_positions: int = 256, chat_template: str = LLAVA_TEMPLATE) -> Path:
    """A tiny random LLaVA-1.5 (CLIP tower of 3 layers over 32x32 pixels in 8x8 patches: 16
    placeholders an image; llama text model) written by transformers, with a BPE tokenizer that
    has an `<image>` token and CLIPImageProcessor's preprocessor_config.json."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                                  "<image>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "bos_token": None, "pad_token": "<|endoftext|>", "chat_template": chat_template,
        "model_max_length": max_positions}))
    text = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                       rms_norm_eps=1e-6, eos_token_id=tok.token_to_id("<|im_end|>"), tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.token_to_id("<image>"),
                      vision_feature_layer=-2, vision_feature_select_strategy="default", projector_hidden_act="gelu",
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # sharp logits, as make_tiny_model's; the tower's spread keeps its features apart
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.25 if "language_model" in name or "lm_head" in name else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return path
