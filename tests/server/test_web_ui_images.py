"""The chat page sends an image to a model that sees, in a real headless Chromium against a real
server (a tiny random LLaVA beside a text model): the page offers the image control only for the
model whose /v1/models card says "vision", the upload goes as an OpenAI image_url part, and the
reply is what the openai client gets for the same message."""
from __future__ import annotations

import base64
from typing import Iterator

import openai
import pytest

from server_process import ServerProcess
from test_vision_api import png
from test_web_ui import browser, by_css, console_errors, set_field, shot, wait_for  # noqa: F401 (browser: a fixture)
from tiny_model import make_tiny_llava, make_tiny_model


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[ServerProcess, str]]:
    root = tmp_path_factory.mktemp("web-vision")
    llava = make_tiny_llava(root / "tiny-llava")
    text = make_tiny_model(root / "tiny-text")
    image = root / "picture.png"
    image.write_bytes(png(48, 40, 5))
    proc = ServerProcess(root / "server.log", "--dtype", "float32", "--max-model-len", "256", "--keep-alive", "-1",
                         model=f"{llava} {text}")
    try:
        proc.wait_healthy()
        yield proc, str(image)
    finally:
        proc.stop()


def busy(driver) -> bool:
    return driver.find_element("tag name", "body").get_attribute("data-busy") == "true"


def test_the_chat_page_uploads_an_image(served, browser):  # noqa: F811 (the fixture)
    from selenium.webdriver.support.ui import Select

    proc, image = served
    browser.get(proc.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(proc.url + "/")
    wait_for(lambda: len(by_css(browser, "#model option")) == 2, 30, "the model list")
    model = Select(by_css(browser, "#model")[0])
    model.select_by_value("tiny-text")
    assert not by_css(browser, "#attach")[0].is_displayed()  # a text model: no image control
    model.select_by_value("tiny-llava")
    wait_for(lambda: by_css(browser, "#attach")[0].is_displayed(), 5, "the image control")
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "8")
    by_css(browser, "#image")[0].send_keys(image)
    wait_for(lambda: by_css(browser, "#attachments img"), 10, "the preview")
    by_css(browser, "#prompt")[0].send_keys("what is this")
    by_css(browser, "#send")[0].click()
    wait_for(lambda: not busy(browser) and len(by_css(browser, ".msg")) == 2, 120, "the reply")
    saved = browser.execute_script("return JSON.parse(localStorage.getItem('tessera.chat.v1')).messages")
    reply = saved[-1]["content"]  # the raw text (the page renders it as Markdown)
    assert saved[0]["content"][1]["image_url"]["url"].startswith("data:image/png;base64,")
    meta = by_css(browser, ".msg.assistant .meta")[-1].text
    assert "Error" not in meta and "tokens" in meta, meta
    assert by_css(browser, ".msg.user .images img") and not by_css(browser, "#attachments img")
    shot(browser, "chat-image")
    assert not console_errors(browser)

    data = "data:image/png;base64," + base64.b64encode(open(image, "rb").read()).decode()
    client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
    expected = client.chat.completions.create(model="tiny-llava", temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is this"},
                                     {"type": "image_url", "image_url": {"url": data}}]}])
    assert reply == expected.choices[0].message.content
