"""The browser pages on a server with API keys, in headless Chromium (as tests/server/test_web_ui.py):
the chat page asks for the key once, on the first 401, keeps it for the tab, and sends it."""
from __future__ import annotations

import httpx
from test_access import ADMIN_KEY, INFERENCE_KEY, keyed_server
from test_web_ui import browser, by_css, wait_for  # noqa: F401 - `browser` is the fixture

__all__ = ["browser"]


def test_chat_page_asks_for_the_key_once_and_keeps_it_for_the_tab(browser):
    with keyed_server() as s:
        assert httpx.get(s.url + "/").status_code == 200  # the page shell itself is open
        browser.get(s.url + "/static/tessera.css")  # this origin, no script: clear the tab's storage
        browser.execute_script("sessionStorage.clear(); localStorage.clear()")
        browser.get(s.url + "/")
        alert = wait_for(lambda: _alert(browser), 10, "the key prompt")
        alert.send_keys(INFERENCE_KEY)
        alert.accept()
        wait_for(lambda: [o.text for o in by_css(browser, "#model option")], 10, "the model list")
        assert browser.execute_script("return sessionStorage.getItem('tessera.apiKey')") == INFERENCE_KEY
        assert browser.execute_script("return localStorage.getItem('tessera.apiKey')") is None
        browser.get(s.url + "/")  # the same tab again: no second prompt
        wait_for(lambda: by_css(browser, "#model option"), 10, "the model list")
        assert _alert(browser) is None
        # a key that the dashboard's endpoint refuses (no admin scope) is asked for again there
        browser.get(s.url + "/dashboard")
        alert = wait_for(lambda: _alert(browser), 10, "the key prompt on the dashboard")
        alert.send_keys(ADMIN_KEY)
        alert.accept()
        wait_for(lambda: browser.execute_script("return sessionStorage.getItem('tessera.apiKey')") == ADMIN_KEY,
                 10, "the admin key kept")
        wait_for(lambda: browser.execute_script(
            "return document.getElementById('dash-model').options.length") > 0, 10, "the dashboard's model list")


def _alert(driver):
    from selenium.common.exceptions import NoAlertPresentException

    try:
        alert = driver.switch_to.alert
        alert.text  # noqa: B018 - raises when there is none
        return alert
    except NoAlertPresentException:
        return None
