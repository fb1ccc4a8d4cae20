"""Images through every API of a real `tessera serve` (engine in its own process) with the
official clients, against transformers: a tiny random LLaVA answers what transformers'
`generate` answers for the same chat (rendered by transformers' own template code), and a
text-only model refuses images with a 400 in each API's error shape."""
from __future__ import annotations

import base64
import io
from typing import Iterator

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
import torch

from server_process import ServerProcess
from tiny_model import make_tiny_llava, make_tiny_model

MAX_TOKENS = 8


def png(width: int, height: int, seed: int, fmt: str = "PNG") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


IMAGE = png(48, 40, 11)
IMAGE_B64 = base64.b64encode(IMAGE).decode()
DATA_URL = "data:image/png;base64," + IMAGE_B64


class Served:
    def __init__(self, proc: ServerProcess, llava: str, text: str, folder, media_dir) -> None:
        self.proc, self.url, self.llava, self.text = proc, proc.url, llava, text
        self.folder, self.media_dir = folder, media_dir
        self.openai = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.anthropic = anthropic.Anthropic(base_url=proc.url, api_key="unused", max_retries=0, timeout=120)
        self.ollama = ollama.Client(host=proc.url, timeout=120)


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("vision")
    llava = make_tiny_llava(root / "tiny-llava")
    text = make_tiny_model(root / "tiny-text")
    media = root / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(IMAGE)
    (root / "outside.png").write_bytes(IMAGE)
    proc = ServerProcess(root / "server.log", "--dtype", "float32", "--max-model-len", "256",
                         "--limit-mm-per-prompt", "image=2", "--max-image-pixels", "1000000",
                         "--allowed-local-media-path", str(media), "--allowed-media-domains", "localhost",
                         "127.0.0.1", "--keep-alive", "-1", model=f"{llava} {text}")
    try:
        proc.wait_healthy()
        yield Served(proc, "tiny-llava", "tiny-text", llava, media)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def expected(served):
    """transformers' answer to one user turn of an image then text, and its prompt length."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaForConditionalGeneration

    from PIL import Image

    tok = AutoTokenizer.from_pretrained(served.folder)
    model = LlavaForConditionalGeneration.from_pretrained(served.folder, dtype=torch.float32).eval()
    proc = CLIPImageProcessorPil.from_pretrained(served.folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    image_id = model.config.image_token_index
    n = (model.config.vision_config.image_size // model.config.vision_config.patch_size) ** 2
    expanded = [t for i in ids for t in ([i] * n if i == image_id else [i])]
    pixels = proc(Image.open(io.BytesIO(IMAGE)).convert("RGB"), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([expanded]), pixel_values=pixels.float(),
                             attention_mask=torch.ones(1, len(expanded), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    return tok.decode(out[0, len(expanded):], skip_special_tokens=True), len(expanded)


def test_openai_chat_image_url(served, expected):
    text, prompt_tokens = expected
    r = served.openai.chat.completions.create(
        model=served.llava, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}},
                                               {"type": "text", "text": "what is this"}]}])
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == prompt_tokens  # the placeholders count as prompt tokens


def test_openai_chat_file_url_under_the_allowed_path(served, expected):
    r = served.openai.chat.completions.create(
        model=served.llava, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": (served.media_dir / "cat.png").as_uri()}},
            {"type": "text", "text": "what is this"}]}])
    assert r.choices[0].message.content == expected[0]


def test_responses_input_image(served, expected):
    r = served.openai.responses.create(
        model=served.llava, max_output_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": DATA_URL},
                                            {"type": "input_text", "text": "what is this"}]}])
    assert r.output_text == expected[0]


def test_anthropic_image_block(served, expected):
    r = served.anthropic.messages.create(
        model=served.llava, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True, "temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE_B64}},
            {"type": "text", "text": "what is this"}]}])
    assert r.content[0].text == expected[0]
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == expected[1]


def test_ollama_images(served, expected):
    r = served.ollama.chat(model=served.llava, messages=[{"role": "user", "content": "what is this",
                                                          "images": [IMAGE_B64]}],
                           options={"temperature": 0, "num_predict": MAX_TOKENS, "ignore_eos": True})
    assert r.message.content == expected[0]
    assert r.prompt_eval_count == expected[1]


def test_images_are_prepared_without_torch(served):
    """The API process's part (reading the model, decoding, processing, the engine's message) in an
    interpreter where torch cannot be imported."""
    import subprocess
    import sys

    code = f"""
import sys, asyncio
sys.modules["torch"] = None
from tessera.engine.frontend import wire
from tessera.engine.input_processor import InputLimits, InputProcessor
from tessera.models.info import load_model_info
from tessera.sampling_params import SamplingParams
from tessera.server.media import MediaSettings, load_images
config, tok = load_model_info({str(served.folder)!r})
images = asyncio.run(load_images([{DATA_URL!r}], config.vision, "m", MediaSettings()))
limits = InputLimits(config.vocab_size, 256, 4096, 1024, image_token_id=config.vision.image_token_id,
                     image_tokens=config.vision.num_image_tokens, image_shape=config.vision.pixel_shape)
p = InputProcessor(tok, limits).process("r", [5, config.vision.image_token_id, 6], SamplingParams(max_tokens=2),
                                        images=images)
frame = wire.encoder().encode(wire.AddRequest(p))
back = wire.request_decoder().decode(frame).request
assert back.images[0].pixels == images[0].pixels and back.images[0].offset == 1
assert len(back.prompt_token_ids) == 2 + config.vision.num_image_tokens
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_ollama_generate_images(served, expected):
    r = served.ollama.generate(model=served.llava, prompt="what is this", images=[IMAGE_B64],
                               options={"temperature": 0, "num_predict": MAX_TOKENS, "ignore_eos": True})
    assert r.response == expected[0]


def test_models_list_says_which_take_images(served):
    cards = {c["id"]: c for c in httpx.get(f"{served.url}/v1/models").json()["data"]}
    assert "vision" in cards[served.llava]["capabilities"]
    show = httpx.post(f"{served.url}/api/show", json={"model": served.llava}).json()
    assert "vision" in show["capabilities"]
    show = httpx.post(f"{served.url}/api/show", json={"model": served.text}).json()
    assert "vision" not in show["capabilities"]


def test_text_model_refuses_images_in_each_api_shape(served):
    with pytest.raises(openai.BadRequestError, match="does not take images"):
        served.openai.chat.completions.create(
            model=served.text, max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]}])
    with pytest.raises(openai.BadRequestError, match="does not take images"):
        served.openai.responses.create(model=served.text, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": DATA_URL}]}])
    with pytest.raises(anthropic.BadRequestError, match="does not take images") as err:
        served.anthropic.messages.create(model=served.text, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE_B64}}]}])
    assert err.value.body["type"] == "error"
    with pytest.raises(ollama.ResponseError, match="does not take images") as oerr:
        served.ollama.chat(model=served.text, messages=[{"role": "user", "content": "hi", "images": [IMAGE_B64]}])
    assert oerr.value.status_code == 400
    served.proc.wait_idle()


def test_templates_without_image_parts_get_the_image_token_before_the_text():
    from tessera.server.media import images_as_text, template_reads_images
    from tiny_model import CHAT_TEMPLATE, LLAVA_TEMPLATE

    assert template_reads_images(LLAVA_TEMPLATE) and not template_reads_images(CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"},
                                             {"type": "text", "text": "and"}, {"type": "image"}]}]
    assert images_as_text(messages, "<image>") == [messages[0], {"role": "user",
                                                                "content": "<image>\n<image>\ncompare\nand"}]


# -- hostile images --------------------------------------------------------------------------

LEAKS = ("Traceback", "root:x:", "PIL.", "File \"", "DecompressionBomb", "site-packages")


def _refused(r: httpx.Response, shape: str) -> str:
    """The error message of a 4xx in the API's own shape (and nothing internal in it)."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    body = r.json()
    if shape == "openai":
        message = body["error"]["message"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
    elif shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
    else:
        message = body["error"]
    assert isinstance(message, str) and not any(leak in message for leak in LEAKS), message
    return message


def test_hostile_images_through_openai_chat(served):
    """tessera bench hostile's image cases against the vision model: each refused for what it is."""
    import json

    from tessera.bench.hostile import hostile_cases

    cases = [c for c in hostile_cases(served.llava) if c.name.startswith("image:")]
    assert len(cases) >= 25
    messages = {}
    with httpx.Client(base_url=served.url, timeout=120) as client:
        for case in cases:
            r = client.post(case.path, content=case.body, headers={"content-type": "application/json"})
            messages[case.name] = _refused(r, "openai")
        # an allowed host that is the server's own loopback address
        body = json.loads(cases[0].body)
        body["messages"][0]["content"][0]["image_url"]["url"] = f"http://localhost:{served.proc.port}/health"
        messages["loopback"] = _refused(client.post("/v1/chat/completions", json=body), "openai")
        # the limit here is image=2
        body["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": DATA_URL}}] * 3
        messages["three"] = _refused(client.post("/v1/chat/completions", json=body), "openai")
    assert "decompression bomb" in messages["image: decompression bomb (30,000^2 PNG)"]
    assert "--max-image-pixels" in messages["image: 6,000^2 PNG over the pixel limit"]
    assert "not accepted" in messages["image: SVG by media type"]
    assert "accepted format" in messages["image: SVG bytes as PNG"]
    assert "accepted format" in messages["image: BMP (not allowed)"]
    assert "truncated" in messages["image: truncated PNG"]
    assert "not valid base64" in messages["image: bad base64"]
    assert "--allowed-media-domains" in messages["image: http host not allowed"]
    assert "--allowed-local-media-path" in messages["image: file outside the allowed path"]
    assert "not a public address" in messages["loopback"]
    assert "at most 2 images" in messages["three"]
    assert served.openai.models.list()  # still serving


def test_hostile_images_through_the_other_apis(served):
    from tessera.bench.hostile_images import SVG, png_bomb, png_header

    bad = [base64.b64encode(png_bomb()).decode(), base64.b64encode(SVG).decode(), "%%%not-base64%%%",
           base64.b64encode(IMAGE[:60]).decode(), base64.b64encode(png_header(16, 16, b"\x00" * 9)).decode()]
    with httpx.Client(base_url=served.url, timeout=120) as client:
        for data in bad:
            _refused(client.post("/v1/messages", json={"model": served.llava, "max_tokens": 4, "messages": [
                {"role": "user", "content": [{"type": "image", "source": {
                    "type": "base64", "media_type": "image/png", "data": data}}]}]}), "anthropic")
            _refused(client.post("/api/chat", json={"model": served.llava, "stream": False, "messages": [
                {"role": "user", "content": "what is this", "images": [data]}]}), "ollama")
            _refused(client.post("/api/generate", json={"model": served.llava, "stream": False,
                                                        "prompt": "what is this", "images": [data]}), "ollama")
            _refused(client.post("/v1/responses", json={"model": served.llava, "max_output_tokens": 4, "input": [
                {"role": "user", "content": [{"type": "input_image",
                                              "image_url": "data:image/png;base64," + data}]}]}), "openai")
        _refused(client.post("/v1/messages", json={"model": served.llava, "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "file:///etc/shadow"}}]}]}),
            "anthropic")
        _refused(client.post("/api/chat", json={"model": served.llava, "stream": False, "messages": [
            {"role": "user", "content": "x", "images": [base64.b64encode(IMAGE).decode()] * 3}]}), "ollama")
        _refused(client.post("/v1/responses", json={"model": served.llava, "input": [
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}), "openai")
    stats = served.proc.wait_idle()  # nothing held: no request, no KV block
    assert stats["scheduler"]["kv_cache_usage"] == 0
    assert "Traceback" not in served.proc.log()


def test_limit_mm_per_prompt_forms():
    from tessera.errors import ConfigError
    from tessera.server.media import parse_mm_limit

    assert parse_mm_limit("image=3") == 3 and parse_mm_limit('{"image": 5}') == 5 and parse_mm_limit(None) == 4
    for bad in ("video=1", "image=-1", "image", "image=x"):
        with pytest.raises(ConfigError):
            parse_mm_limit(bad)
