"""A tiny random LLaVA against transformers: the processor's pixels, and greedy tokens through the
engine with one and two images, alone and batched with text prompts, with chunk boundaries
inside an image's placeholders, and through the prefix cache (float32)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from tessera.images import ImageLimits, image_input, preprocess
from tessera.llm import LLM
from tessera.sampling_params import InvalidRequestError, SamplingParams

from tiny_model import make_tiny_llava

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def png(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


IMAGES = [png(40, 52, 1), png(64, 48, 2), png(33, 33, 3, "JPEG")]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def loaded(folder):
    from tessera.models.loader import load_model

    return load_model(folder, "float32")


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def make_llm(loaded, **opts) -> LLM:
    opts.setdefault("max_model_len", 256)
    return LLM(str(loaded.path), loaded=loaded, **opts)


def prompt(loaded, *pieces) -> list[int]:
    """Token ids of text pieces with an image token for each None."""
    v = loaded.config.vision
    ids: list[int] = []
    for p in pieces:
        ids += [v.image_token_id] if p is None else loaded.tokenizer.encode(p, add_special_tokens=False)
    return ids


def oracle(hf, loaded, ids: list[int], images: list[bytes], max_tokens: int = 12) -> list[int]:
    """transformers' greedy tokens for the prompt with its image tokens expanded as the engine does."""
    v = loaded.config.vision
    expanded: list[int] = []
    for t in ids:
        expanded += [t] * v.num_image_tokens if t == v.image_token_id else [t]
    kwargs = {}
    if images:
        pixels = [np.frombuffer(image_input(b, v, ImageLimits()).pixels, dtype=np.float32).reshape(v.pixel_shape)
                  for b in images]
        kwargs["pixel_values"] = torch.from_numpy(np.stack(pixels))
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([expanded]), attention_mask=torch.ones(1, len(expanded), dtype=torch.long),
                          max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens, **kwargs)
    return out[0, len(expanded):].tolist()


def test_preprocessing_matches_clip_image_processor(folder, loaded):
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    proc = CLIPImageProcessorPil.from_pretrained(folder)
    for data in IMAGES + [png(300, 17, 4), png(8, 8, 5)]:
        ours = preprocess(Image.open(io.BytesIO(data)).convert("RGB"), loaded.config.vision.processing)
        theirs = proc(Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="np")["pixel_values"][0]
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_one_and_two_images_match_transformers_alone_and_batched(loaded, hf):
    cases = [(prompt(loaded, "the quick brown ", None, " fox jumps"), IMAGES[:1]),
             (prompt(loaded, None, "hello world ", None, " blocks"), IMAGES[:2]),
             (prompt(loaded, "paged attention ", None), IMAGES[2:])]
    want = [oracle(hf, loaded, ids, imgs) for ids, imgs in cases]
    texts = [prompt(loaded, "prefix caching reuses"), prompt(loaded, "continuous batching serves many")]
    want_text = [oracle(hf, loaded, ids, []) for ids in texts]
    llm = make_llm(loaded)
    for (ids, imgs), w in zip(cases, want):
        assert llm.generate([ids], GREEDY, images=[imgs])[0].outputs[0].token_ids == w
    batch = [ids for ids, _ in cases] + texts
    outs = make_llm(loaded).generate(batch, GREEDY, images=[imgs for _, imgs in cases] + [[], []])
    assert [o.outputs[0].token_ids for o in outs] == want + want_text
    n = loaded.config.vision.num_image_tokens
    assert len(outs[1].prompt_token_ids) == len(cases[1][0]) - 2 + 2 * n  # placeholders are prompt tokens


@pytest.mark.parametrize("budget", [5, 7, 13])
def test_chunk_boundaries_inside_images_match(loaded, hf, budget):
    ids = prompt(loaded, "the quick ", None, " brown ", None, " fox")
    want = oracle(hf, loaded, ids, IMAGES[:2])
    llm = make_llm(loaded, max_num_batched_tokens=budget, max_num_seqs=3, enable_prefix_caching=False)
    outs = llm.generate([ids, prompt(loaded, "hello world"), ids], GREEDY,
                        images=[IMAGES[:2], [], IMAGES[:2]])
    assert outs[0].outputs[0].token_ids == want
    assert outs[2].outputs[0].token_ids == want


def test_prefix_cache_keys_blocks_by_image(loaded, hf):
    ids = prompt(loaded, "the quick brown fox jumps over the lazy dog ", None, " what is this")
    llm = make_llm(loaded, block_size=16)
    first = llm.generate([ids], GREEDY, images=[IMAGES[:1]])[0]
    same = llm.generate([ids], GREEDY, images=[IMAGES[:1]])[0]
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert same.num_cached_tokens >= 16 * ((len(first.prompt_token_ids) - 1) // 16)  # the whole prompt hit
    encoded = llm.engine.runner.images.num_encoded
    other = llm.generate([ids], GREEDY, images=[IMAGES[1:2]])[0]
    assert other.outputs[0].token_ids == oracle(hf, loaded, ids, IMAGES[1:2])
    text_before = len(prompt(loaded, "the quick brown fox jumps over the lazy dog "))
    assert other.num_cached_tokens <= text_before  # nothing past the first block holding the image
    assert llm.engine.runner.images.num_encoded == encoded + 1
    assert first.outputs[0].token_ids != other.outputs[0].token_ids


def test_placeholder_and_image_counts_must_agree(loaded):
    llm = make_llm(loaded)
    with pytest.raises(InvalidRequestError, match="image placeholders"):
        llm.generate([prompt(loaded, "hello ", None)], GREEDY, images=[IMAGES[:2]])
    with pytest.raises(InvalidRequestError, match="image placeholders"):
        llm.generate([prompt(loaded, "hello ", None)], GREEDY)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_images_right(loaded, hf, mode):
    """A cache too small for four image prompts at once: requests are preempted mid-way and
    resumed (recomputed from the kept encoder output, or swapped back)."""
    cases = [(prompt(loaded, "the quick ", None, " brown fox"), IMAGES[i % 3:i % 3 + 1]) for i in range(4)]
    want = [oracle(hf, loaded, ids, imgs, max_tokens=20) for ids, imgs in cases]
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # 2 layers, K and V, 2 kv heads, head_dim 16, fp32, 16 tokens
    llm = make_llm(loaded, kv_cache_memory=6 * block_bytes, preemption_mode=mode, enable_prefix_caching=False,
                   max_num_batched_tokens=16)
    outs = llm.generate([ids for ids, _ in cases], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                        images=[imgs for _, imgs in cases])
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0
