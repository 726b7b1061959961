"""The built-in page in a real headless browser (Debian's chromium + chromedriver via selenium),
against a real `sidecar serve` with an API key: the page loads without the key and without any
network beyond the server, asks for the key, streams an answer into the page and keeps its engine
view updated from /metrics."""

from __future__ import annotations

import re

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

KEY = "page-key"
WAIT_S = 120


@pytest.fixture(scope="module")
def server(sidecar_launcher):
    with sidecar_launcher("--api-key", f"{KEY}:page") as sc:
        yield sc


@pytest.fixture(scope="module")
def browser():
    opts = Options()
    opts.binary_location = "/usr/bin/chromium"
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1200,900",
        # No network but the server: every other host fails to resolve, and a dead proxy takes the rest.
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
        "--proxy-server=http://127.0.0.1:9",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def test_page_and_assets_load_without_a_key(server):
    r = httpx.get(server.http_base + "/", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
        a = httpx.get(f"{server.http_base}/ui/{name}", timeout=30)
        assert a.status_code == 200 and a.headers["content-type"].startswith(kind) and a.content
    assert httpx.get(server.http_base + "/ui/__init__.py", timeout=30).status_code == 404
    assert httpx.get(server.http_base + "/v1/models", timeout=30).status_code == 401


def _wait(driver, what, timeout=WAIT_S):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: what(d))


def test_chat_streams_into_the_page_and_stats_update(server, browser):
    base = server.http_base
    browser.get(base + "/")
    panel = browser.find_element(By.ID, "key-panel")
    _wait(browser, lambda d: panel.is_displayed())  # /v1/models answered 401: the page asks for a key
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    _wait(browser, lambda d: [o.text for o in d.find_elements(By.CSS_SELECTOR, "#model option")] == ["demo"])
    assert not panel.is_displayed()
    assert "serving demo" in browser.find_element(By.ID, "server-state").text
    generated_before = int(
        _wait(
            browser,
            lambda d: (
                d.find_element(By.ID, "m-generated").text.isdigit()
                and d.find_element(By.ID, "m-generated").text
            ),
        )
    )

    tokens = browser.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys("24")
    # Count the reply's text changes as they happen: a streamed answer changes more than once.
    browser.execute_script(
        "window.__updates = 0; new MutationObserver(() => window.__updates++)"
        ".observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});"
    )
    browser.find_element(By.ID, "prompt").send_keys("Tell me a story")
    browser.find_element(By.ID, "send").click()
    reply = _wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant[data-done='true']"))
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Tell me a story"
    assert browser.execute_script("return window.__updates") > 3
    stats = reply.find_element(By.CLASS_NAME, "stats").text
    assert re.search(
        r"TTFT \d+ ms · TPOT [\d.]+ ms · 24 tokens · \d+ of \d+ prompt tokens cached · cache \w+", stats
    ), stats
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")

    # The engine view polls /metrics: the generated-token count grows by the answer, the plots fill.
    _wait(browser, lambda d: int(d.find_element(By.ID, "m-generated").text) >= generated_before + 24)
    samples = int(browser.find_element(By.ID, "p-tps").get_attribute("data-samples"))
    _wait(browser, lambda d: int(d.find_element(By.ID, "p-tps").get_attribute("data-samples")) > samples)
    assert re.fullmatch(r"\d+(\.\d) %", browser.find_element(By.ID, "m-kv").text)
    assert browser.find_element(By.ID, "m-running").text.isdigit()
    # The test server runs without the semantic cache; the prefix cache saw the prompt.
    assert browser.find_element(By.ID, "m-semantic").text == "no lookups"
    assert browser.find_element(By.ID, "m-prefix").text.endswith(" %")

    # Everything the page loaded came from the server itself.
    urls = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(base + "/") for u in urls), urls
