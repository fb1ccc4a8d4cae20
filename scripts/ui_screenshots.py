"""The README's screenshots of the chat page and the dashboard, taken in headless Chromium.

    python scripts/ui_screenshots.py --out docs/images

Starts `tessera serve` for the chat model, asks one question in the chat page and waits for the
whole reply; then starts a server for the dashboard model, runs `--clients` streaming clients
against it for `--load-s` seconds and captures the dashboard. Needs chromium, chromedriver and
selenium (as tests/server/test_web_ui.py).
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tessera.bench.client import launch_server, stop_server
from tessera.bench.datasets import VOCABULARY


def browser(width: int, height: int) -> webdriver.Chrome:
    opts = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                "--hide-scrollbars"):
        opts.add_argument(arg)
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or "chromedriver"), options=opts)


def wait(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the page did not get there in time")
        time.sleep(0.2)


def chat_shot(url: str, out: Path, question: str) -> None:
    d = browser(1280, 860)
    try:
        d.get(url + "/")
        wait(lambda: d.find_elements(By.CSS_SELECTOR, "#model option"), 10)
        for field, value in (("temperature", "0"), ("max_tokens", "400")):
            el = d.find_element(By.ID, field)
            el.clear()
            el.send_keys(value)
        d.find_element(By.ID, "system").send_keys("You are a concise coding assistant.")
        box = d.find_element(By.ID, "prompt")
        box.send_keys(question)
        box.send_keys(Keys.ENTER)
        wait(lambda: d.find_element(By.TAG_NAME, "body").get_attribute("data-busy") == "false", 300)
        d.save_screenshot(str(out / "chat.png"))
    finally:
        d.quit()


def dashboard_shot(url: str, model: str, out: Path, clients: int, load_s: float) -> None:
    stop = threading.Event()

    def client(seed: int) -> None:
        import random

        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=120) as c:
            while not stop.is_set():
                words = " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(20, 400)))
                with c.stream("POST", "/v1/completions", json={
                        "model": model, "prompt": words, "max_tokens": rng.randint(32, 160), "stream": True}) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    d = browser(1400, 1250)
    try:
        d.get(url + "/dashboard")
        time.sleep(load_s)
        d.save_screenshot(str(out / "dashboard.png"))
    finally:
        d.quit()
        stop.set()
        for t in threads:
            t.join(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--chat-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--question", default="Write a Python function that checks whether a string is a palindrome, "
                                          "with a short explanation.")
    p.add_argument("--dashboard-model", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--load-s", type=float, default=75.0)
    p.add_argument("--port", type=int, default=8131)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="tessera-shots-"))
    url = f"http://127.0.0.1:{args.port}"
    proc = launch_server(args.chat_model, args.port, logs / "chat.log")
    try:
        chat_shot(url, args.out, args.question)
    finally:
        stop_server(proc)
    proc = launch_server(args.dashboard_model, args.port, logs / "dashboard.log")
    try:
        dashboard_shot(url, args.dashboard_model, args.out, args.clients, args.load_s)
    finally:
        stop_server(proc)
    print(f"wrote {args.out / 'chat.png'} and {args.out / 'dashboard.png'}")


if __name__ == "__main__":
    main()
