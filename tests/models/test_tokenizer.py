"""Tokenizer and IncrementalDetokenizer: fast tests on tiny trained tokenizers, model tests on the real ones."""
from __future__ import annotations

import pytest

from conftest import TINY_CHAT_TEMPLATE, build_tiny_tokenizer
from oracle_store import hf_tokenizer
from tessera.sampling_params import InvalidRequestError
from tessera.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world! This is a test.",
    "  leading spaces and\n\nnew lines\tand tabs",
    "Grüße aus München, naïve café",
    "東京タワー 🙂🚀 and 👨‍👩‍👧 family",
    "def add(a, b):\n    return a + b  # sum",
    "don't won't I'm 1234567 3.14159",
]


def tiny_tokenizer(chat_template: str | None = TINY_CHAT_TEMPLATE) -> Tokenizer:
    hf = build_tiny_tokenizer()
    return Tokenizer(hf.backend_tokenizer, bos_token_id=0, eos_token_ids=[2], chat_template=chat_template,
                     special_tokens_map=dict(hf.special_tokens_map), name="tiny")


def sentencepiece_tokenizer() -> Tokenizer:
    """A Metaspace (sentencepiece-style) BPE: its decoder drops the space of a leading '▁'."""
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator([t for t in TEXTS if t.isascii()] * 5, vocab_size=200, show_progress=False,
                           special_tokens=["<s>", "</s>", "<unk>"])
    return Tokenizer(sp._tokenizer, bos_token_id=0, eos_token_ids=[1], chat_template=None,
                     special_tokens_map={"bos_token": "<s>", "eos_token": "</s>"}, name="sp")


def stream(tok: Tokenizer, prompt: list[int], generated: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.add(t) for t in generated]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("make", [tiny_tokenizer, sentencepiece_tokenizer])
def test_streamed_text_equals_full_decode(make):
    tok = make()
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for split in (0, 1, len(ids) // 2):
            deltas = stream(tok, ids[:split], ids[split:])
            assert "".join(deltas) == tok.decode(ids)[len(tok.decode(ids[:split])):]
            if tok.name == "tiny" or text.isascii():
                assert not any("\ufffd" in d for d in deltas)


def test_never_emits_half_a_character():
    tok = tiny_tokenizer()
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's 4 bytes are separate byte-level tokens here
    deltas = stream(tok, tok.encode("Hi ", add_special_tokens=False), ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🙂"


def test_sentencepiece_leading_spaces_survive_streaming():
    tok = sentencepiece_tokenizer()
    ids = tok.encode("Hello world this is a test", add_special_tokens=False)
    # one token at a time, each decoded alone, would lose the spaces; the window keeps them
    assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids)
    assert "".join(stream(tok, [], ids)) == tok.decode(ids) == "Hello world this is a test"


def test_special_tokens_skipped_or_kept():
    tok = tiny_tokenizer()
    hello = tok.encode("Hello", add_special_tokens=False)
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end == [2]
    assert "".join(stream(tok, [], hello + im_end, skip=True)) == "Hello"
    assert "".join(stream(tok, [], hello + im_end, skip=False)) == "Hello<|im_end|>"


def test_tokenizer_api_matches_transformers():
    hf = build_tiny_tokenizer()
    tok = tiny_tokenizer()
    assert tok.vocab_size == len(hf)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
        ids = hf.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.token_text(2) == "<|im_end|>"
    assert tok.token_text(tok.encode("Hello", add_special_tokens=False)[0]) in "Hello"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    for gen in (True, False):
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen)


def test_chat_template_errors_are_request_errors():
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tiny_tokenizer(chat_template=None).apply_chat_template([{"role": "user", "content": "hi"}])
    strict = tiny_tokenizer("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                            "{% endif %}{{ messages[0]['content'] }}")
    with pytest.raises(InvalidRequestError, match="first must be user"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="empty"):
        strict.apply_chat_template([])


def test_hf_folder_tokenizer(tiny_model_dir):
    tok = Tokenizer.from_hf_folder(tiny_model_dir("llama"), config_eos_ids=(2,))
    assert tok.eos_token_ids[0] == 2 and tok.bos_token_id == 0
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# -- the packaged models' tokenizers ---------------------------------------------

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]
END_OF_TURN = {"smollm2-135m": "<|im_end|>", "qwen2.5-coder-0.5b": "<|im_end|>", "gemma3-270m": "<end_of_turn>"}


@pytest.mark.model
@pytest.mark.parametrize("name", MODELS)
def test_real_tokenizer_matches_transformers(model_path, name):
    path = model_path(name)
    tok = Tokenizer.from_gguf(path)
    hf = hf_tokenizer(path)
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>", "<start_of_turn>user\nhi<end_of_turn>"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
        body = tok.encode(text, add_special_tokens=False)
        assert "".join(stream(tok, body[:2], body[2:])) == tok.decode(body)[len(tok.decode(body[:2])):]
    assert tok.eos_token_ids[0] == hf.eos_token_id
    assert tok.encode(END_OF_TURN[name], add_special_tokens=False)[0] in tok.eos_token_ids
    messages = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Write a haiku."}]
    if hf.chat_template:
        for conversation in (messages, messages[1:2]):
            assert tok.apply_chat_template(conversation) == hf.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True)
    else:  # this GGUF carries no template: chat is refused rather than guessed
        with pytest.raises(InvalidRequestError, match="no chat template"):
            tok.apply_chat_template(messages)


def test_hf_folder_tokenizers_load_on_parallel_threads(tiny_model_dir):
    """Replicas' front ends load their tokenizers at once; transformers' lazy top-level names failed
    there (ImportError: cannot import name 'AutoTokenizer') when threads reached them together.
    A fresh interpreter, so transformers is not imported yet."""
    import subprocess
    import sys

    code = (
        "import sys, threading\n"
        "from tessera.tokenizer import Tokenizer\n"
        "errors = []\n"
        "def load():\n"
        "    try:\n"
        "        Tokenizer.from_hf_folder(sys.argv[1])\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=load) for _ in range(4)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert not errors, errors\n"
    )
    folder = tiny_model_dir("llama")
    for _ in range(2):  # the race lost on every try before the fix; twice is plenty
        run = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
