"""The built-in web page in a real browser: Debian's chromium, headless, driven by
Playwright against the real daemon on the tiny model. A person's steps: pick a picture,
type a question, press Send, watch the answer arrive; ask a follow-up; stop an answer;
read an error; give a key. The page must load nothing from another origin and raise no
script error. A screenshot is kept in build/artifacts/ for CI."""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qvld.http.keys import hash_key
from tests.test_http import RECEIPT, HttpDaemon

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[1] / "build" / "artifacts"
LIVE = "[aria-live=polite]"
# Installs a recorder of every text the live region shows (CDP's evaluate is not bound
# by the page's Content-Security-Policy; the page itself may not eval anything).
RECORD = """() => {
  window.__seen = [];
  const live = document.querySelector('[aria-live=polite]');
  new MutationObserver(() => window.__seen.push(live.textContent))
    .observe(live, {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    # Long answers (the random model rarely ends one), so that Stop has one to stop.
    d = HttpDaemon(tmp_path_factory.mktemp("web"), args=[
        "--set", "engine.default_max_tokens=1500", "--set", "engine.max_new_tokens=1500"]
                   ).start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield instance
        finally:
            instance.close()


class Page:
    """A tab on the daemon's page, recording script errors and every request made."""

    def __init__(self, browser: Any, daemon: HttpDaemon, **options: Any) -> None:
        self.base = f"http://127.0.0.1:{daemon.port}"
        self.context = browser.new_context(viewport={"width": 900, "height": 800}, **options)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("console", lambda m: self.errors.append(m.text)
                     if m.type == "error" and "Failed to load resource" not in m.text
                     else None)
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.goto(self.base + "/")

    def ask(self, question: str, picture: Path | None = None, enter: bool = False) -> None:
        if picture is not None:
            self.page.set_input_files("input[type=file]", str(picture))
            from playwright.sync_api import expect

            expect(self.page.get_by_alt_text("The picture to ask about")).to_be_visible()
        self.page.fill("textarea", question)
        if enter:
            self.page.press("textarea", "Enter")
        else:
            self.page.get_by_role("button", name="Send").click()

    def foreign_requests(self) -> list[str]:
        # blob: URLs of this origin are the picked picture, in the browser's memory.
        return [u for u in self.requests
                if not u.startswith((self.base + "/", f"blob:{self.base}/"))]

    def close(self) -> None:
        self.context.close()


def cached_tokens(text: str) -> int:
    match = re.search(r"cached (\d+)", text)
    assert match, text
    return int(match.group(1))


def test_ask_about_a_picture_then_follow_up(browser: Any, daemon: HttpDaemon) -> None:
    from playwright.sync_api import expect

    tab = Page(browser, daemon)
    page = tab.page
    try:
        expect(page.locator("#model")).to_contain_text("context")
        live = page.locator(LIVE)
        page.evaluate(RECORD)
        tab.ask("What is the total on this receipt?", RECEIPT)
        # #49: the picture left the turn while its answer streamed; turns had no labels.
        expect(page.get_by_alt_text("The picture asked about")).to_be_visible()
        expect(live).to_contain_text("first token", timeout=60_000)
        seen = [t for t in page.evaluate("window.__seen") if "first token" not in t]
        grown = [t for i, t in enumerate(seen) if t and (i == 0 or t != seen[i - 1])]
        # It grew in several steps, each the one before plus more.
        assert len(grown) >= 3, grown
        assert all(b.startswith(a) for a, b in itertools.pairwise(grown)), grown
        first_answer = page.locator("#answer-text").inner_text()
        assert cached_tokens(live.inner_text()) == 0
        assert re.search(r"first token \d+\.\d\d s · [\d.]+ tokens/s · prompt \d+ tokens",
                         live.inner_text())
        # A follow-up with the keyboard: the same conversation, its history cached.
        tab.ask("And the date?", enter=True)
        expect(page.locator(".turn")).to_have_count(1)
        expect(live).to_contain_text("first token", timeout=60_000)
        turn = page.locator(".turn").inner_text()
        assert "What is the total on this receipt?" in turn
        assert [label.lower() for label in page.locator(".turn .who").all_inner_texts()] == [
            "you", "qvld"]
        expect(page.locator(".turn img")).to_be_visible()
        expect(page.locator("#latest-picture")).to_be_hidden()  # the follow-up had none
        assert first_answer[:40] in turn
        assert "And the date?" in page.locator("#latest").inner_text()
        assert cached_tokens(live.inner_text()) > 100  # the first turn, picture included
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-ui.png"), full_page=True)
        page.set_viewport_size({"width": 380, "height": 800})  # a phone's width
        page.screenshot(path=str(ARTIFACTS / "web-ui-phone.png"), full_page=True)
        assert page.evaluate("document.documentElement.scrollWidth") <= 380
        assert tab.foreign_requests() == [] and tab.errors == []
    finally:
        tab.close()


def test_stop_ends_the_answer_in_the_daemon(browser: Any, daemon: HttpDaemon) -> None:
    from playwright.sync_api import expect

    tab = Page(browser, daemon)
    page = tab.page
    try:
        expect(page.locator("#model")).to_contain_text("context")
        # #49: only the model id and context length were shown.
        expect(page.locator("#model")).to_contain_text("openvino")
        expect(page.locator("#model")).to_contain_text("takes text, image, video")
        tab.ask("Describe this picture in detail.", RECEIPT)
        expect(page.locator("#answer-text")).not_to_have_text("", timeout=60_000)
        page.get_by_role("button", name="Stop").click()
        expect(page.locator(LIVE)).to_contain_text("(stopped)")
        daemon.wait_queue(0, 0, timeout=10)  # the generation ended in the daemon too
        expect(page.get_by_role("button", name="Send")).to_be_enabled()
        assert "cancelled" in daemon.log()
        # #49: Escape stopped an answer only from the question box, and a stopped
        # answer had no timings line. Now from anywhere, with what the page measured.
        expect(page.locator("#timings")).to_contain_text("stopped after")
        tab.ask("And describe it again, slowly.")
        expect(page.locator("#answer-text")).not_to_have_text("", timeout=60_000)
        page.evaluate("document.activeElement && document.activeElement.blur()")
        page.keyboard.press("Escape")
        expect(page.locator(LIVE)).to_contain_text("(stopped)")
        expect(page.locator("#timings")).to_contain_text("stopped after")
        daemon.wait_queue(0, 0, timeout=10)
        assert tab.errors == []
    finally:
        tab.close()


def test_settings_are_kept_in_the_browser_and_asked_with(browser: Any,
                                                         daemon: HttpDaemon) -> None:
    """#49: no temperature, max tokens, system prompt or answer format could be set."""
    from playwright.sync_api import expect

    tab = Page(browser, daemon)
    page = tab.page
    try:
        expect(page.locator("#model")).to_contain_text("context")
        page.get_by_text("Settings").click()
        page.get_by_label("Temperature").fill("0")
        page.get_by_label("Max tokens").fill("6")
        page.get_by_label("Answer format").select_option("json_object")
        page.get_by_label("System prompt").fill("Answer in JSON.")
        page.reload()  # kept in this browser
        expect(page.locator("#model")).to_contain_text("context")
        page.get_by_text("Settings").click()
        expect(page.get_by_label("Max tokens")).to_have_value("6")
        expect(page.get_by_label("Answer format")).to_have_value("json_object")
        expect(page.get_by_label("System prompt")).to_have_value("Answer in JSON.")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-ui-settings.png"), full_page=True)
        bodies: list[dict[str, Any]] = []
        page.on("request", lambda r: bodies.append(json.loads(r.post_data or "{}"))
                if r.url.endswith("/v1/chat/completions") else None)
        tab.ask("Describe this picture.", RECEIPT)
        live = page.locator(LIVE)
        expect(live).to_contain_text("first token", timeout=60_000)
        answered = re.search(r"answer (\d+) tokens", live.inner_text())
        assert answered and int(answered.group(1)) <= 6
        text = page.locator("#answer-text").inner_text().replace(
            " …(cut at the token limit)", "")
        assert isinstance(json.loads(text), dict)  # the format closed the answer in time
        (body,) = bodies
        assert (body["temperature"], body["max_tokens"], body["response_format"]) == (
            0, 6, {"type": "json_object"})
        assert body["messages"][0] == {"role": "system", "content": "Answer in JSON."}
        assert tab.errors == []
    finally:
        tab.page.evaluate("localStorage.clear()")
        tab.close()


def test_errors_are_shown_in_words(browser: Any, daemon: HttpDaemon, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    fake = tmp_path / "fake.png"
    fake.write_bytes(b"this is text, not a picture")
    tab = Page(browser, daemon)
    page = tab.page
    try:
        expect(page.locator("#model")).to_contain_text("context")
        tab.ask("What is this?", fake)
        alert = page.get_by_role("alert")
        expect(alert).to_contain_text("The server could not use this request")
        expect(alert).to_contain_text("PNG, JPEG, WebP, GIF or BMP")
        # The page goes on: a question without a picture is answered.
        page.get_by_role("button", name="New chat").click()
        expect(alert).to_be_hidden()
        tab.ask("Hello?")
        expect(page.locator(LIVE)).to_contain_text("first token", timeout=60_000)
    finally:
        tab.close()


def test_a_key_is_asked_for_and_kept_for_the_tab(browser: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    key = "qvld-test-key-web-0123456789"
    keys = tmp_path / "keys"
    keys.write_text(f"alice:{hash_key(key)}\n")
    keys.chmod(0o600)
    d = HttpDaemon(tmp_path, args=["--set", f"http.api_keys_file={keys}",
                                   "--set", "engine.default_max_tokens=8"]).start()
    tab = Page(browser, d)
    page = tab.page
    try:
        form = page.locator("#key-form")
        expect(form).to_be_visible()
        page.get_by_label("API key").fill("wrong")
        page.get_by_role("button", name="Use key").click()
        expect(page.locator("#model")).to_contain_text("needs an API key")
        page.get_by_label("API key").fill(key)
        page.get_by_role("button", name="Use key").click()
        expect(page.locator("#model")).to_contain_text("context")
        expect(form).to_be_hidden()
        tab.ask("Hi")
        expect(page.locator(LIVE)).to_contain_text("first token", timeout=60_000)
        assert page.evaluate("sessionStorage.getItem('qvld-key')") == key
        assert page.evaluate("localStorage.length") == 0
        assert all(key not in url for url in tab.requests)
        page.reload()  # the same tab keeps it
        expect(page.locator("#model")).to_contain_text("context")
        other = Page(browser, d)  # another tab (its own context) does not have it
        try:
            expect(other.page.locator("#key-form")).to_be_visible()
        finally:
            other.close()
        assert tab.foreign_requests() == []
        assert "user=alice" in d.log() or '"user": "alice"' in d.log()
    finally:
        tab.close()
        d.stop()


def test_a_page_on_another_origin_cannot_act_as_its_visitor(daemon: HttpDaemon,
                                                           browser: Any) -> None:
    """#46: a page from another origin ran generations as its visitor with a no-cors
    fetch of text/plain and a plain form post, neither needing a CORS preflight. Served
    from another port here (another origin), in Chromium: both reach the daemon and are
    refused (403), and no generation runs; the daemon's own page still answers."""
    import http.server
    import threading
    import time

    api = f"http://127.0.0.1:{daemon.port}/v1/chat/completions"
    ask = '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'
    evil = f"""<!doctype html><body>
<form id=f method=POST action="{api}" enctype="text/plain" target=sink>
<input name='{ask[:-1]}, "x": "' value='"}}'></form><iframe name=sink></iframe>
<script>
fetch("{api}", {{method: "POST", mode: "no-cors", body: '{ask}'}})
  .finally(() => document.getElementById("f").submit());
</script></body>""".encode()

    class Evil(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(evil)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    before = daemon.log()
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        deadline = time.monotonic() + 30
        while daemon.log()[len(before):].count("op=generate") < 2:
            assert time.monotonic() < deadline, daemon.log()[len(before):]
            page.wait_for_timeout(100)
    finally:
        context.close()
        server.shutdown()
    lines = [line for line in daemon.log()[len(before):].splitlines() if "op=generate" in line]
    assert len(lines) == 2 and all("outcome=forbidden" in line for line in lines), lines
    from playwright.sync_api import expect

    tab = Page(browser, daemon)  # the visitor's own page is still theirs
    try:
        tab.ask("Hello?")
        expect(tab.page.locator(LIVE)).to_contain_text("first token", timeout=60_000)
        assert tab.errors == []
    finally:
        tab.close()
