"""The chat page at ``/`` and the ``mtp_trace`` stream extension, with the demo model.

The HTTP tests check the extension itself: absent unless asked for, and exact when asked (the
tokens marked as accepted drafts are ``usage.speculative.accepted``, their texts are the
reply). The browser tests drive the page in headless Chromium from the system's packages
(tests/browser.py; skipped with the reason where none is installed): a streamed reply with its
marking and figures, Enter / Shift+Enter, stop mid-stream (the server cancels the generation),
K=0 without marking, the API-key prompt, and model text escaped before markdown.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import find_browser, start_chromium
from fake_engine import FakeEngine, LiveServer, metric

from server.app import create_app
from server.page import PAGE_DIR
from server.settings import ServerSettings

DEMO = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
PROMPT = "Write the function read_lines: Return a list of the lines in the file at path."


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    from engine.runtime import Engine

    app = create_app(
        lambda: Engine.load(str(DEMO), draft_tokens=2), ServerSettings(model=str(DEMO))
    )
    with LiveServer(app) as srv:
        srv.model = app.state.mtp.names[0]
        yield srv


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def stream_chat(http: httpx.Client, model: str, **body: Any) -> list[dict[str, Any]]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 96,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    chunks = []
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    return chunks


# -- the page's files and the extension over plain HTTP ------------------------------------------


@pytest.mark.fast
def test_page_is_served_and_fetches_nothing_from_elsewhere(http: httpx.Client) -> None:
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    for name, kind in (("page.js", "javascript"), ("page.css", "text/css")):
        r = http.get(f"/page/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert "greedy" in http.get("/page/presets.json").json()
    # Only same-origin references: the one absolute URL is the SVG namespace (never fetched).
    for path in PAGE_DIR.iterdir():
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s'\"`)]*", path.read_text()))
        assert urls <= {"http://www.w3.org/2000/svg"}, (path.name, urls)


@pytest.mark.fast
def test_trace_is_opt_in(server: LiveServer, http: httpx.Client) -> None:
    chunks = stream_chat(http, server.model)
    assert chunks and all("mtp_trace" not in c for ch in chunks for c in ch["choices"])
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}]}
    reply = http.post("/v1/chat/completions", json={**body, "max_tokens": 8, "mtp_trace": True})
    assert reply.status_code == 200 and "mtp_trace" not in reply.json()["choices"][0]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.fast
def test_trace_marks_exactly_the_accepted_drafts(server: LiveServer, http: httpx.Client, n: int):
    chunks = stream_chat(http, server.model, mtp_trace=True, n=n, seed=3, temperature=0.8)
    usage = chunks[-1]["usage"]
    spec = usage["speculative"]
    tokens: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n)}
    content = {i: "" for i in range(n)}
    histogram = [0] * 9
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            content[choice["index"]] += choice["delta"].get("content") or ""
            trace = choice.get("mtp_trace")
            if trace:
                tokens[choice["index"]] += trace["tokens"]
                histogram[trace["draft_tokens"]] += 1
    marked = sum(t["drafted"] for ts in tokens.values() for t in ts)
    assert marked == spec["accepted"] > 0
    assert sum(map(len, tokens.values())) == usage["completion_tokens"]
    assert histogram[: len(spec["cycles_by_draft_tokens"])] == spec["cycles_by_draft_tokens"]
    for i in range(n):
        assert "".join(t["text"] for t in tokens[i]) == content[i]


# -- the page in a browser ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    found = find_browser()
    if isinstance(found, str):
        pytest.skip(f"no headless browser: {found}")
    session = start_chromium(*found)
    try:
        yield session
    finally:
        session.quit()


def by(css: str) -> tuple[str, str]:
    from selenium.webdriver.common.by import By

    return By.CSS_SELECTOR, css


def wait(driver: Any, condition: Any, timeout: float = 60) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def open_page(driver: Any, url: str) -> None:
    """A fresh page: no conversation, no saved settings or key, the model name loaded."""
    driver.get(url + "/")
    driver.execute_script("localStorage.clear()")
    driver.get(url + "/")
    wait(driver, lambda d: d.find_element(*by("#model")).text not in ("", "…"))


def settings(driver: Any, **values: str) -> None:
    """Fill settings fields the way a person does: open the panel, type or choose, close it."""
    from selenium.webdriver.support.ui import Select

    driver.find_element(*by("#settings-toggle")).click()
    for name, value in values.items():
        field = driver.find_element(*by(f"#{name}"))
        if field.tag_name == "select":
            Select(field).select_by_value(value)
        else:
            field.clear()
            field.send_keys(value)
    driver.find_element(*by("#settings-toggle")).click()


def send(driver: Any, text: str) -> Any:
    """Type ``text`` and press Enter; returns the new reply's element."""
    from selenium.webdriver.common.keys import Keys

    before = len(driver.find_elements(*by(".msg.assistant")))
    box = driver.find_element(*by("#prompt"))
    box.click()
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    wait(driver, lambda d: len(d.find_elements(*by(".msg.assistant"))) > before)
    return driver.find_elements(*by(".msg.assistant"))[-1]


def finished(driver: Any, reply: Any, timeout: float = 60) -> str:
    wait(driver, lambda d: reply.get_attribute("data-done"), timeout)
    return reply.get_attribute("data-done")


def test_reply_streams_with_exact_draft_marking(driver: Any, server: LiveServer) -> None:
    from selenium.webdriver.common.keys import Keys

    open_page(driver, server.url)
    assert driver.find_element(*by("#model")).text == server.model
    box = driver.find_element(*by("#prompt"))
    assert driver.switch_to.active_element == box
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "second line")
    assert box.get_attribute("value") == "first line\nsecond line"
    assert not driver.find_elements(*by(".msg"))  # Shift+Enter did not send
    box.clear()
    settings(driver, temperature="0", max_tokens="96")
    reply = send(driver, PROMPT)
    assert driver.find_element(*by(".msg.user")).text == PROMPT
    assert finished(driver, reply) == "finished"
    assert reply.find_element(*by(".content pre code")).text.strip()  # a rendered code block
    figures = reply.find_element(*by(".figures"))
    marked = int(figures.get_attribute("data-marked"))
    assert marked == int(figures.get_attribute("data-usage-accepted")) > 0
    spans = reply.find_elements(*by(".drf"))
    assert spans and len({s.get_attribute("data-t") for s in spans}) <= marked
    assert figures.find_elements(*by("svg rect.acc"))
    assert "tokens/s" in figures.text and "acceptance" in figures.text
    assert driver.switch_to.active_element == driver.find_element(*by("#prompt"))


def test_stop_mid_stream_cancels_the_generation(
    driver: Any, server: LiveServer, http: httpx.Client
) -> None:
    open_page(driver, server.url)
    cancelled = metric(http, 'mtpserve_generations_total{outcome="cancelled"}')
    settings(driver, max_tokens="4000", extra='{"ignore_eos": true}')
    reply = send(driver, "Tell me a long story.")
    content = reply.find_element(*by(".content"))
    wait(driver, lambda d: content.text.strip())
    seen = content.text
    wait(driver, lambda d: len(content.text) > len(seen))  # the text grows while streaming
    assert driver.find_element(*by("#stop")).is_displayed()
    driver.find_element(*by("#stop")).click()
    assert finished(driver, reply, 10) == "stopped"
    assert driver.find_element(*by("#send")).is_displayed()
    assert "stopped" in reply.find_element(*by(".state")).text
    deadline = time.monotonic() + 20
    while (
        metric(http, 'mtpserve_generations_total{outcome="cancelled"}') <= cancelled
        or http.get("/health").json()["running"]
    ):
        assert time.monotonic() < deadline, "the server did not cancel the generation"
        time.sleep(0.05)


def test_k0_shows_no_draft_marking(driver: Any, server: LiveServer) -> None:
    open_page(driver, server.url)
    settings(driver, temperature="0", max_tokens="48", draft_tokens="0")
    reply = send(driver, PROMPT)
    assert finished(driver, reply) == "finished"
    assert reply.find_element(*by(".content")).text.strip()
    assert not reply.find_elements(*by(".drf"))
    figures = reply.find_element(*by(".figures"))
    assert figures.get_attribute("data-marked") == figures.get_attribute("data-usage-accepted")
    assert figures.get_attribute("data-marked") == "0"
    assert not figures.find_elements(*by("svg rect.acc"))


def test_page_asks_for_the_api_key(driver: Any) -> None:
    app = create_app(FakeEngine(), ServerSettings(api_key="page-secret"))
    with LiveServer(app) as srv:
        assert httpx.get(srv.url + "/").status_code == 200  # the page itself is open
        driver.get(srv.url + "/")
        driver.execute_script("localStorage.clear()")
        driver.get(srv.url + "/")
        dialog = driver.find_element(*by("#key-dialog"))
        wait(driver, lambda d: dialog.get_attribute("open") is not None)
        driver.find_element(*by("#key")).send_keys("page-secret")
        driver.find_element(*by("#key-save")).click()
        wait(driver, lambda d: d.find_element(*by("#model")).text == "fake-model")
        assert driver.execute_script("return localStorage.getItem('mtpserve.apiKey')") == (
            "page-secret"
        )
        reply = send(driver, "TRIGGER_PLAIN <img src=x> **bold**")
        assert finished(driver, reply, 30) == "finished"
        assert "The answer is 42." in reply.find_element(*by(".content")).text
        # Text is escaped before markdown is rendered: the tag shows as text, never as HTML.
        user = driver.find_element(*by(".msg.user"))
        assert "<img src=x>" in user.text and not user.find_elements(*by("img"))
        assert user.find_element(*by("strong")).text == "bold"
