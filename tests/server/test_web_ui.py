"""The chat page and the dashboard in a real headless Chromium (Selenium), against a real server.

Needs Debian's `chromium` and `chromium-driver` (.ci/run installs them and sets
TESSERA_REQUIRE_BROWSER=1, so CI fails rather than skips without them). Screenshots
go to $TESSERA_TEST_ARTIFACTS (default build/test-artifacts/web-ui).
"""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from server_process import ServerProcess, running_server

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
ARTIFACTS = Path(os.environ.get("TESSERA_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "build" / "test-artifacts"))


def _browser_paths() -> tuple[str, str] | None:
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    return (binary, driver) if binary and driver else None


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("serve") / "server.log", "--max-num-seqs", "8") as proc:
        yield proc


@pytest.fixture(scope="module")
def browser():
    paths = _browser_paths()
    if paths is None:
        message = "no chromium + chromedriver (apt-get install chromium chromium-driver) for the browser tests"
        if os.environ.get("TESSERA_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(arg)
    opts.binary_location = paths[0]
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(paths[1]), options=opts)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver, name: str) -> None:
    folder = ARTIFACTS / "web-ui"
    folder.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(folder / f"{name}.png"))


def wait_for(predicate: Callable[[], object], timeout: float = 60, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def by_css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def text_of(driver, selector: str) -> str:
    """An element's text read in one script call (the dashboard replaces its tiles every refresh)."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : ''",
                                 selector)


def open_chat(driver, server: ServerProcess, fresh: bool = True) -> None:
    driver.get(server.url + "/")
    if fresh:
        driver.execute_script("localStorage.clear()")
        driver.get(server.url + "/")
    wait_for(lambda: by_css(driver, "#model option"), 10, "the model list")


def set_field(driver, element_id: str, value: str) -> None:
    el = by_css(driver, "#" + element_id)[0]
    el.clear()
    el.send_keys(value)


def test_pages_assets_and_headers(server):
    for path in ("/", "/dashboard"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in r.headers["content-security-policy"]
    for asset in ("chat.js", "dashboard.js", "tessera.css", "vendor/marked.umd.js", "vendor/purify.min.js",
                  "vendor/highlight.min.js", "vendor/uPlot.iife.min.js"):
        assert httpx.get(f"{server.url}/static/{asset}").status_code == 200, asset
    live = httpx.get(server.url + "/v1/engine/live", params={"seconds": 30}).json()
    assert live["models"][0]["model"] == MODEL and len(live["models"][0]["series"]["t"]) == 30
    assert live["models"][0]["settings"]["max_num_seqs"] == 8
    assert httpx.get(server.url + "/v1/engine/live", params={"seconds": 0}).status_code == 400
    # The pages are not API operations: the OpenAPI schema (fuzzed by schemathesis) leaves them out.
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert "/" not in paths and "/dashboard" not in paths and "/v1/engine/live" in paths


def test_chat_streams_renders_markdown_and_keeps_the_conversation(server, browser):
    open_chat(browser, server)
    set_field(browser, "temperature", "0")
    set_field(browser, "max_tokens", "96")
    prompt = by_css(browser, "#prompt")[0]
    prompt.send_keys("Write a Python function that adds two numbers. Use a code block.")
    from selenium.webdriver.common.keys import Keys

    prompt.send_keys(Keys.ENTER)  # Enter sends
    # Text arrives while the request is still running: streamed, not one final block.
    wait_for(lambda: browser.find_element("tag name", "body").get_attribute("data-busy") == "true"
             and by_css(browser, ".msg.assistant .body")[-1].text.strip(), 60, "streamed text")
    wait_for(lambda: browser.find_element("tag name", "body").get_attribute("data-busy") == "false", 120,
             "the reply to finish")
    text = by_css(browser, ".msg.assistant .body")[-1].text.strip()
    meta = by_css(browser, ".msg.assistant .meta")[-1].text
    assert text
    assert "TTFT" in meta and "tok/s" in meta and "tokens" in meta, meta
    if by_css(browser, ".msg.assistant .body pre code"):  # Markdown code block, highlighted
        assert by_css(browser, ".msg.assistant .body pre code.hljs")
    shot(browser, "chat")
    # Kept in the browser: a reload shows the same conversation.
    browser.refresh()
    wait_for(lambda: len(by_css(browser, ".msg")) == 2, 10, "the saved conversation")
    assert by_css(browser, ".msg.assistant .body")[-1].text.strip() == text
    assert not console_errors(browser)


def test_stop_cancels_the_request_on_the_server(server, browser):
    from selenium.webdriver.common.keys import Keys

    open_chat(browser, server)
    set_field(browser, "max_tokens", "3000")
    set_field(browser, "temperature", "1.0")
    prompt = by_css(browser, "#prompt")[0]
    prompt.send_keys("Tell me a very long story about a lighthouse keeper and the sea.")
    prompt.send_keys(Keys.ENTER)
    wait_for(lambda: len(by_css(browser, ".msg.assistant .body")[-1].text) > 20, 60, "some streamed text")
    assert server.stats()["scheduler"]["num_running"] == 1
    by_css(browser, "#stop")[0].click()
    wait_for(lambda: browser.find_element("tag name", "body").get_attribute("data-busy") == "false", 10, "stop")
    assert "stopped" in by_css(browser, ".msg.assistant .meta")[-1].text
    assert by_css(browser, "#status")[0].text == "Stopped."
    server.wait_idle(timeout=10)  # the server let go of the request and its KV blocks
    wait_for(lambda: "client disconnected mid-stream; aborted" in server.log(), 10, "the abort in the log")
    # Escape stops too (keyboard only).
    prompt = by_css(browser, "#prompt")[0]
    prompt.send_keys("Another long story, please.")
    prompt.send_keys(Keys.ENTER)
    wait_for(lambda: by_css(browser, ".msg.assistant .body")[-1].text.strip(), 60, "text")
    prompt.send_keys(Keys.ESCAPE)
    wait_for(lambda: browser.find_element("tag name", "body").get_attribute("data-busy") == "false", 10, "Esc")
    server.wait_idle(timeout=10)
    assert not console_errors(browser)


def test_keyboard_reaches_every_control(server, browser):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    open_chat(browser, server)
    browser.find_element("tag name", "body").click()
    reached = set()
    for _ in range(30):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        active = browser.switch_to.active_element
        reached.add(active.get_attribute("id") or active.tag_name)
    assert {"model", "system", "temperature", "max_tokens", "new-chat", "prompt", "send"} <= reached, reached


@pytest.mark.parametrize("path", ["/", "/dashboard"])
def test_readable_at_phone_width(server, browser, path):
    browser.set_window_size(390, 844)
    try:
        browser.get(server.url + path)
        wait_for(lambda: browser.execute_script("return document.readyState") == "complete", 10, "load")
        time.sleep(0.5)
        overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"{path} scrolls sideways by {overflow}px at phone width"
        shot(browser, "phone-" + ("chat" if path == "/" else "dashboard"))
        assert not console_errors(browser)
    finally:
        browser.set_window_size(1280, 900)


def test_dashboard_charts_move_under_load(server, browser):
    browser.get(server.url + "/dashboard")
    wait_for(lambda: int(browser.find_element("tag name", "body").get_attribute("data-updates") or 0) >= 1, 15,
             "the first refresh")
    canvas = "return document.querySelector('#chart-throughput canvas').toDataURL()"
    before = browser.execute_script(canvas)
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not stop.is_set():
                c.post("/v1/completions", json={"model": MODEL, "prompt": "The sea was", "max_tokens": 24,
                                                "ignore_eos": True})

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        wait_for(lambda: text_of(browser, "#tile-generation .value") not in ("0", "–"), 30,
                 "throughput in the summary")
        wait_for(lambda: text_of(browser, "#tile-requests .value").split(" / ")[0] not in ("0", "–"), 30,
                 "running requests")
        updates = int(browser.find_element("tag name", "body").get_attribute("data-updates"))
        wait_for(lambda: int(browser.find_element("tag name", "body").get_attribute("data-updates")) > updates, 10,
                 "another refresh")
        assert browser.execute_script(canvas) != before  # the throughput line moved
        label = by_css(browser, "#chart-ttft")[0].get_attribute("aria-label")
        assert "p50" in label and "–" not in label.split("p50")[1].split(",")[0], label
        shot(browser, "dashboard")
    finally:
        stop.set()
        for w in workers:
            w.join()
    settings = text_of(browser, "#settings")
    assert "max num seqs" in settings and "kv cache dtype" in settings
    assert not console_errors(browser)
    server.wait_idle()
