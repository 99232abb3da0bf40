"""The built-in web page in a real browser: Debian's chromium, headless, driven by
Playwright against the real daemon on the tiny model. A person's steps: pick a picture,
type a question, press Send, watch the answer arrive; ask a follow-up; stop an answer;
read an error; give a key. The page must load nothing from another origin and raise no
script error. A screenshot is kept in build/artifacts/ for CI."""

from __future__ import annotations

import base64
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qvld.http.keys import hash_key
from tests.conftest import TINY, wait_for
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
        "--set", "engine.default_max_tokens=1500", "--set", "engine.max_new_tokens=1500",
        # A clip of 2 s at 350x200 (50 frames) within, one of 3 s past it.
        "--set", f"engine.max_clip_decode_pixels={60 * 350 * 200}"]).start()
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
            self.page.set_input_files("#image", str(picture))
            from playwright.sync_api import expect

            expect(self.page.get_by_alt_text("The picture to ask about")).to_be_visible()
        self.page.fill("#question", question)
        if enter:
            self.page.press("#question", "Enter")
        else:
            self.page.get_by_role("button", name="Send").click()

    def ready_with_max_tokens(self, tokens: int) -> None:
        """Wait for the page to know the model, then set Max tokens in its settings."""
        from playwright.sync_api import expect

        expect(self.page.locator("#model")).to_contain_text("context")
        self.page.get_by_text("Settings").click()
        self.page.get_by_label("Max tokens").fill(str(tokens))

    def chat_bodies(self) -> list[dict[str, Any]]:
        """The bodies the page posts to /v1/chat/completions from now on, in order."""
        bodies: list[dict[str, Any]] = []
        self.page.on("request", lambda r: bodies.append(json.loads(r.post_data or "{}"))
                     if r.url.endswith("/v1/chat/completions") else None)
        return bodies

    def wait_answer(self) -> str:
        """Wait for the answer being streamed to end (Send is back); its timings line."""
        from playwright.sync_api import expect

        expect(self.page.get_by_role("button", name="Send")).to_be_enabled(timeout=60_000)
        return str(self.page.locator("#timings").inner_text())

    def foreign_requests(self) -> list[str]:
        # blob: URLs of this origin are the picked picture, in the browser's memory.
        return [u for u in self.requests
                if not u.startswith((self.base + "/", f"blob:{self.base}/"))]

    def close(self) -> None:
        self.context.close()


def prompt_tokens(text: str) -> int:
    match = re.search(r"prompt (\d+) tokens", text)
    assert match, text
    return int(match.group(1))


def cached_tokens(text: str) -> int:
    match = re.search(r"cached (\d+)", text)
    assert match, text
    return int(match.group(1))


def test_ask_about_a_picture_then_follow_up(browser: Any, daemon: HttpDaemon) -> None:
    from playwright.sync_api import expect

    tab = Page(browser, daemon)
    page = tab.page
    bodies = tab.chat_bodies()
    try:
        expect(page.locator("#model")).to_contain_text("context")
        live = page.locator(LIVE)
        tab.ask("What is the total on this receipt?", RECEIPT)
        page.evaluate(RECORD)
        # #49: the picture left the turn while its answer streamed; turns had no labels.
        expect(page.get_by_alt_text("The picture asked about")).to_be_visible()
        expect(live).to_contain_text("first token", timeout=60_000)
        seen = [t for t in page.evaluate("window.__seen") if "first token" not in t]
        grown = [t for i, t in enumerate(seen) if t and (i == 0 or t != seen[i - 1])]
        assert len(grown) >= 3, grown  # it grew in several steps
        first_answer = page.locator("#answer-text").inner_text()
        assert cached_tokens(live.inner_text()) == 0
        assert re.search(r"first token \d+\.\d\d s · [\d.]+ tokens/s · prompt \d+ tokens",
                         live.inner_text())
        # A follow-up with the keyboard: the same conversation, its history cached.
        tab.ask("And the date?", enter=True)
        expect(page.locator(".turn")).to_have_count(2)
        expect(live).to_contain_text("first token", timeout=60_000)
        turn = page.locator(".turn").first.inner_text()
        assert "What is the total on this receipt?" in turn
        assert [label.lower() for label in page.locator(".turn").first.locator(
            ".who").all_inner_texts()] == ["you", "qvld"]
        expect(page.locator(".turn").first.locator("img")).to_be_visible()
        expect(page.locator(".turn.latest .attachment")).to_have_count(0)  # it had none
        assert first_answer[:40] in turn
        assert "And the date?" in page.locator(".turn.latest").inner_text()
        assert cached_tokens(live.inner_text()) > 100  # the first turn, picture included
        # On the daemon's session: only the new question, with the turns it expects.
        assert len(bodies) == 2 and len(bodies[1]["messages"]) == 1
        assert bodies[1]["session_turns"] == 1
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
        # The request's log line is written once its handler has settled it.
        wait_for(lambda: "cancelled" in daemon.log(), 10, "the stopped request's log line",
                 detail=daemon.log)
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


def test_conversations_are_kept_continued_and_branched(browser: Any,
                                                       daemon: HttpDaemon) -> None:
    """#49: a reload lost everything; no regenerate, no editing a question."""
    from playwright.sync_api import expect

    tab = Page(browser, daemon)
    page = tab.page
    bodies = tab.chat_bodies()
    try:
        tab.ready_with_max_tokens(20)
        tab.ask("What is the total on this receipt?", RECEIPT)
        assert "answer 20 tokens" in tab.wait_answer()  # max tokens 20: 20 tokens
        first_answer = page.locator("#answer-text").inner_text()
        page.reload()  # kept in this browser: the conversation, its picture, its answer
        expect(page.locator(".turn")).to_have_count(1)
        expect(page.get_by_alt_text("The picture asked about")).to_be_visible()
        assert page.locator("#answer-text").inner_text() == first_answer
        expect(page.locator("#conversation-list .open")).to_have_text(
            ["What is the total on this receipt?"])
        tab.ask("And the date?")
        timings = tab.wait_answer()
        assert cached_tokens(timings) > 100, timings  # continued on the daemon's session
        assert bodies[-1]["session_turns"] == 1 and len(bodies[-1]["messages"]) == 1
        # Regenerate replaces the last answer (the first stays as a branch).
        before = page.locator("#answer-text").inner_text()
        page.get_by_text("Settings").click()
        page.get_by_label("Temperature").fill("1")
        page.get_by_role("button", name="Regenerate this answer").click()
        tab.wait_answer()
        expect(page.locator(".turn")).to_have_count(2)
        expect(page.locator(".turn.latest")).to_contain_text("branch 2 of 2")
        assert page.locator("#answer-text").inner_text() != before
        # A regenerated answer is on a new session with the branch's history sent whole.
        assert bodies[-1]["session_turns"] == 0 and len(bodies[-1]["messages"]) == 3
        # Editing the first question starts a branch from there.
        page.get_by_role("button", name="Edit this question").first.click()
        expect(page.locator("#editing")).to_be_visible()
        expect(page.locator("#question")).to_have_value("What is the total on this receipt?")
        expect(page.get_by_alt_text("The picture to ask about")).to_be_visible()
        page.fill("#question", "Who issued this receipt?")
        page.get_by_role("button", name="Send").click()
        tab.wait_answer()
        expect(page.locator(".turn")).to_have_count(1)
        expect(page.locator(".turn.latest")).to_contain_text("Who issued this receipt?")
        expect(page.locator(".turn.latest")).to_contain_text("branch 2 of 2")
        page.get_by_role("button", name="Previous branch").click()  # the old branch back
        expect(page.locator(".turn")).to_have_count(2)
        expect(page.locator(".turn").first).to_contain_text("What is the total")
        # A second conversation is listed on its own; search finds each.
        page.get_by_role("button", name="New chat").click()
        expect(page.locator(".turn")).to_have_count(0)
        tab.ask("Name three colours.")
        tab.wait_answer()
        expect(page.locator("#conversation-list .open")).to_have_count(2)
        expect(page.locator("#conversation-list [aria-current=true]")).to_have_text(
            "Name three colours.")
        # A phrase, not a word: the random model's answers are words of the test prompts
        # ("receipt" among them), and the search reads answers too.
        page.fill("#search", "the total on this receipt")
        expect(page.locator("#conversation-list .open")).to_have_text(
            ["What is the total on this receipt?"])
        page.fill("#search", "")
        page.get_by_role("button", name="Rename Name three colours.").click()
        page.get_by_label("New name").fill("Colours")
        page.get_by_label("New name").press("Enter")
        expect(page.locator("#conversation-list .open")).to_have_text(
            ["Colours", "What is the total on this receipt?"])
        # Export, delete, import: the same conversations, pictures included.
        with page.expect_download() as download:
            page.get_by_role("button", name="Export").click()
        exported = json.loads(Path(download.value.path()).read_text())
        assert exported["qvld_conversations"] == 1 and len(exported["conversations"]) == 2
        picture = next(t["attachment"] for c in exported["conversations"]
                       for t in c["turns"].values() if t["attachment"])
        assert picture["data"].startswith("data:image/")
        page.once("dialog", lambda dialog: dialog.accept())
        page.get_by_role("button", name="Delete What is the total on this receipt?").click()
        expect(page.locator("#conversation-list .open")).to_have_text(["Colours"])
        saved = Path(download.value.path())
        page.set_input_files("#import-file", str(saved))
        expect(page.locator("#notice")).to_contain_text("Imported 2 conversations")
        expect(page.locator("#conversation-list .open")).to_have_count(2)
        page.get_by_role("button", name="What is the total on this receipt?", exact=True).click()
        expect(page.get_by_alt_text("The picture asked about")).to_be_visible()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-ui-conversations.png"), full_page=True)
        assert tab.foreign_requests() == [] and tab.errors == []
    finally:
        tab.page.evaluate("localStorage.clear()")
        tab.close()


def test_markdown_is_shown_as_markdown_and_never_as_markup(browser: Any,
                                                           daemon: HttpDaemon) -> None:
    """#49: the model's markdown was raw text. Rendered with DOM nodes only: markup the
    model writes stays text, links open safely, images are never loaded."""
    from playwright.sync_api import expect

    tab = Page(browser, daemon)
    page = tab.page
    try:
        expect(page.locator("#model")).to_contain_text("context")
        answer = ("# Total\n\nIt is **12.50** in `EUR`, see [the shop](https://shop.example)."
                  "\n\n- milk\n- bread\n\n| item | price |\n|---|--:|\n| milk | 1 |\n\n"
                  "```python\nprint('<b>')\n```\n\n<img src=x onerror=alert(1)> "
                  "![a](https://tracker.example/p.png) [bad](javascript:alert(1))")
        html = page.evaluate("""(text) => {
            const box = document.createElement('div');
            box.append(Markdown.render(text));
            document.getElementById('transcript').append(box);
            return {html: box.innerHTML, tags: [...box.querySelectorAll('*')].map(
                (n) => n.tagName.toLowerCase()),
                links: [...box.querySelectorAll('a')].map((a) => [a.href, a.rel])};
        }""", answer)
        assert set(html["tags"]) <= {"h3", "p", "strong", "code", "a", "ul", "li", "div",
                                     "table", "thead", "tbody", "tr", "th", "td", "span",
                                     "button", "pre", "br"}, html["tags"]
        assert "&lt;img src=x onerror=alert(1)&gt;" in html["html"]
        assert "&lt;b&gt;" in html["html"]  # inside the code block, as text
        assert ["https://shop.example/", "noopener noreferrer"] in html["links"]
        assert all(href.startswith("https:") for href, _ in html["links"])  # no javascript:
        assert "tracker.example" not in "".join(tab.requests)
        # The answer copied to the clipboard (a code block's Copy button too).
        tab.context.grant_permissions(["clipboard-read", "clipboard-write"])
        page.get_by_role("button", name="Copy the python block").click()
        expect(page.get_by_role("button", name="Copy the python block")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()") == "print('<b>')"
        tab.ask("Hello?")
        tab.wait_answer()
        page.get_by_role("button", name="Copy this answer").click()
        expect(page.locator("#notice")).to_have_text("The answer was copied.")
        copied = page.evaluate("navigator.clipboard.readText()")
        assert copied and copied == page.evaluate(
            "state.conversation.turns[state.conversation.leaf].answer")
        assert tab.errors == []
    finally:
        tab.close()


def test_a_clip_is_uploaded_and_answered(browser: Any, daemon: HttpDaemon,
                                         tmp_path: Path) -> None:
    """#49: "clip.mp4 is not a picture", though the daemon takes video."""
    from playwright.sync_api import expect

    tab = Page(browser, daemon)
    page = tab.page
    try:
        expect(page.locator("#model")).to_contain_text("context")
        tab.ask("Hello?")
        alone = prompt_tokens(tab.wait_answer())
        page.get_by_role("button", name="New chat").click()
        page.set_input_files("#image", str(TINY / "images" / "clip.mp4"))
        expect(page.get_by_label("The clip to ask about")).to_be_visible()
        page.fill("#question", "Hello?")
        page.get_by_role("button", name="Send").click()
        expect(page.get_by_label("The clip asked about")).to_be_visible()
        with_clip = prompt_tokens(tab.wait_answer())
        assert with_clip > alone + 50, (alone, with_clip)
        # Too large for the server: refused in words before anything is sent.
        big = tmp_path / "long.mp4"
        with big.open("wb") as f:
            f.truncate(40 * 1024 * 1024)
        page.set_input_files("#image", str(big))
        alert = page.get_by_role("alert")
        expect(alert).to_contain_text("long.mp4 is 41.9 MB; this server takes a clip of up to")
        notes = tmp_path / "notes.txt"
        notes.write_text("notes")
        page.set_input_files("#image", str(notes))
        expect(alert).to_contain_text("neither a picture nor a clip")
        assert tab.foreign_requests() == [] and tab.errors == []
    finally:
        tab.page.evaluate("localStorage.clear()")
        tab.close()



def make_clip(path: Path, codec: str, container: str | None = None, frames: int = 50,
              options: dict[str, str] | None = None) -> Path:
    """A 2 s clip of 350x200 at 25 fps (a moving gradient), as people film them."""
    import av
    import numpy as np

    with av.open(str(path), "w", format=container, options=options or {}) as out:
        stream = out.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = 350, 200, "yuv420p"
        y, x = np.mgrid[0:200, 0:350]
        for i in range(frames):
            frame = np.stack([(x + 5 * i) % 256, y % 256, np.full_like(x, 9 * i % 256)], -1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame.astype(np.uint8),
                                                                   format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def api_prompt_tokens(daemon: HttpDaemon, question: str, clip: Path | None) -> int:
    """The prompt's tokens for ``question`` (and ``clip``) asked through the API."""
    content: list[dict[str, Any]] = [{"type": "text", "text": question}]
    if clip is not None:
        url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
        content.insert(0, {"type": "video_url", "video_url": {"url": url}})
    status, _, body = daemon.request("POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode())
    assert status == 200, body
    return int(body["usage"]["prompt_tokens"])


@pytest.mark.slow  # four clips through the page: a minute and more
def test_a_clip_in_each_container_is_sent_with_its_question(browser: Any, daemon: HttpDaemon,
                                                            tmp_path: Path) -> None:
    """#61: a clip chosen in the page was answered without it (its prompt the question's
    alone). H.264 in MP4, VP9 in WebM, H.264 in MKV through the file input, MPEG-4 Part 2
    (which Chromium cannot play) dropped onto the page: each is sent, its tokens in the
    prompt, its turn showing its name and size (and the clip itself where this browser
    plays it); Regenerate of a clip's turn sends the clip again."""
    from playwright.sync_api import expect

    clips = [(make_clip(tmp_path / "street.mp4", "libx264"), True),
             (make_clip(tmp_path / "garden.webm", "libvpx-vp9"), True),
             (make_clip(tmp_path / "beach.mkv", "libx264", "matroska"), True),
             (make_clip(tmp_path / "old-camera.mp4", "mpeg4"), False)]
    question = "What happens in this clip?"
    alone = api_prompt_tokens(daemon, question, None)
    tab = Page(browser, daemon)
    page = tab.page
    bodies = tab.chat_bodies()
    try:
        tab.ready_with_max_tokens(3)
        for clip, playable in clips:
            page.get_by_role("button", name="New chat").click()
            if playable:
                page.set_input_files("#image", str(clip))
            else:  # dropped onto the page, as a file from the desktop
                transfer = page.evaluate_handle(
                    """([data, name]) => {
                      const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
                      const transfer = new DataTransfer();
                      transfer.items.add(new File([bytes], name, {type: "video/mp4"}));
                      return transfer;
                    }""", [base64.b64encode(clip.read_bytes()).decode(), clip.name])
                page.dispatch_event("#drop", "drop", {"dataTransfer": transfer})
            expect(page.locator("#preview-file")).to_contain_text(clip.name)
            page.fill("#question", question)
            page.get_by_role("button", name="Send").click()
            prompt = prompt_tokens(tab.wait_answer())
            clip_tokens = api_prompt_tokens(daemon, question, clip) - alone
            assert clip_tokens > 50 and prompt == alone + clip_tokens, (clip.name, prompt)
            sent = bodies[-1]["messages"][-1]["content"]
            assert [part["type"] for part in sent] == ["video_url", "text"], clip.name
            turn = page.locator(".turn.latest")
            expect(turn.locator(".file-chip")).to_contain_text(f"{clip.name} · ")
            shown = turn.get_by_label("The clip asked about")
            if playable:
                expect(shown).to_be_visible()
            else:  # this browser cannot decode it: the chip stands for it
                expect(shown).to_be_hidden()
        # Regenerate of the last clip's turn sends the clip again.
        page.get_by_role("button", name="Regenerate this answer").click()
        assert prompt_tokens(tab.wait_answer()) == prompt
        assert [part["type"] for part in bodies[-1]["messages"][-1]["content"]] == \
            ["video_url", "text"]
        # A clip the daemon cannot decode: its reason in words, the question and the
        # clip back in the box to try again.
        broken = tmp_path / "broken.mp4"
        broken.write_bytes(b"\x00\x00\x00\x18ftypisom" + b"not a video" * 100)
        status, _, refusal = daemon.request("POST", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," +
                                                    base64.b64encode(broken.read_bytes())
                                                    .decode()}},
                {"type": "text", "text": question}]}]}).encode())
        assert status == 400 and refusal["error"]["code"] == "video_invalid", refusal
        page.get_by_role("button", name="New chat").click()
        page.set_input_files("#image", str(broken))
        page.fill("#question", question)
        page.get_by_role("button", name="Send").click()
        expect(page.get_by_role("alert")).to_contain_text(refusal["error"]["message"])
        expect(page.locator("#question")).to_have_value(question)
        expect(page.locator("#preview-file")).to_contain_text("broken.mp4")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-ui-clip.png"), full_page=True)
        assert tab.foreign_requests() == [] and tab.errors == []
    finally:
        tab.page.evaluate("localStorage.clear()")
        tab.close()


def test_a_clip_the_daemon_would_refuse_is_refused_before_it_is_sent(
        browser: Any, daemon: HttpDaemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """#61: the page reads a clip's header (its frames' size and count, as the daemon's
    decoder counts them, in MP4, MOV, fragmented MP4, WebM and MKV) and refuses one past
    /v1/models' clip_limits in the daemon's own words, sending nothing; a clip within
    them chosen and sent at once goes with its question."""
    import av
    from playwright.sync_api import expect

    from qvld.engine.inputs import video
    from qvld.engine.model.model_dir import VideoSpec
    from qvld.errors import VideoInvalid

    clips = [make_clip(tmp_path / "end.mp4", "libx264"),  # the index after the frames
             make_clip(tmp_path / "start.mp4", "libx264", options={"movflags": "faststart"}),
             make_clip(tmp_path / "camera.mov", "libx264", "mov", frames=37),
             make_clip(tmp_path / "recorded.mp4", "libx264", frames=61, options={
                 "movflags": "frag_keyframe+empty_moov+default_base_moof"}),
             make_clip(tmp_path / "garden.webm", "libvpx-vp9", frames=45),
             make_clip(tmp_path / "beach.mkv", "libx264", "matroska", frames=75)]
    long = clips[-1]

    def daemon_reads(clip: Path) -> dict[str, int]:
        """Width, height and frames as the daemon's decoder reads them."""
        container = av.open(str(clip))
        stream = container.streams.video[0]
        try:
            return {"width": stream.width, "height": stream.height,
                    "frames": video._frame_count(clip.read_bytes(), stream)}
        finally:
            container.close()

    def daemon_refusal(clip: Path, frame_pixels: int, clip_pixels: int) -> str:
        with pytest.raises(VideoInvalid) as refused:
            video.decode_frames(clip.read_bytes(), VideoSpec(), 10_000, frame_pixels,
                                lambda: False, lambda count, h, w: (h, w), clip_pixels)
        return str(refused.value)

    tab = Page(browser, daemon)
    page = tab.page
    bodies = tab.chat_bodies()
    read = """async ([data, name]) => ClipHeader.read(new File(
        [Uint8Array.from(atob(data), (c) => c.charCodeAt(0))], name))"""
    refusal = "([header, limits]) => ClipHeader.refusal(header, limits)"
    try:
        tab.ready_with_max_tokens(3)
        for clip in clips:
            header = page.evaluate(read, [base64.b64encode(clip.read_bytes()).decode(),
                                          clip.name])
            assert header == daemon_reads(clip), clip.name
        assert page.evaluate(read, [base64.b64encode(b"\x1aE\xdf\xa3 not a clip").decode(),
                                    "x.webm"]) is None
        # Each bound in the daemon's words (its decoder refusing the same clip).
        header = daemon_reads(long)
        wide = {"max_frame_pixels": 350 * 200 - 1, "max_decoded_pixels": 10 ** 10,
                "max_frames": 10 ** 6}
        assert page.evaluate(refusal, [header, wide]) == daemon_refusal(
            long, 350 * 200 - 1, 10 ** 10)
        monkeypatch.setattr(video, "MAX_DECODED_FRAMES", 74)
        assert page.evaluate(refusal, [header, {**wide, "max_frame_pixels": 10 ** 6,
                                                "max_frames": 74}]) == daemon_refusal(
            long, 10 ** 6, 10 ** 10)
        monkeypatch.undo()
        # Through the page: refused from /v1/models' limits, nothing sent.
        status, _, listed = daemon.request("GET", "/v1/models")
        assert status == 200
        limits = listed["data"][0]["clip_limits"]
        words = daemon_refusal(long, limits["max_frame_pixels"], limits["max_decoded_pixels"])
        page.set_input_files("#image", str(long))
        expect(page.get_by_role("alert")).to_contain_text(f"beach.mkv is not sent: {words}")
        expect(page.locator("#preview-file")).to_be_hidden()
        assert page.eval_on_selector("#image", "input => input.files.length") == 0
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web-ui-clip-refused.png"))
        status, _, api = daemon.request("POST", "/v1/chat/completions", json.dumps({
            "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "data:video/x-matroska;base64," +
                                                    base64.b64encode(long.read_bytes())
                                                    .decode()}},
                {"type": "text", "text": "?"}]}]}).encode())
        assert status == 400 and api["error"]["message"] == words
        # Chosen and sent in one go (Send pressed while the header is read): the refusal
        # keeps the question in the box, and nothing is sent without the clip.
        page.evaluate("""([data, name, question]) => {
          const transfer = new DataTransfer();
          transfer.items.add(new File([Uint8Array.from(atob(data), (c) => c.charCodeAt(0))],
                                      name, {type: "video/x-matroska"}));
          const input = document.getElementById("image");
          input.files = transfer.files;
          input.dispatchEvent(new Event("change"));
          document.getElementById("question").value = question;
          document.getElementById("send").click();
        }""", [base64.b64encode(long.read_bytes()).decode(), "at-once.mkv", "At once?"])
        expect(page.get_by_role("alert")).to_contain_text(f"at-once.mkv is not sent: {words}")
        expect(page.locator("#question")).to_have_value("At once?")
        # A clip within them, sent the moment it is chosen: it goes with the question.
        page.set_input_files("#image", str(clips[0]))
        page.fill("#question", "What happens in this clip?")
        page.get_by_role("button", name="Send").click()
        tab.wait_answer()
        assert len(bodies) == 1  # the refused ones sent nothing
        assert [part["type"] for part in bodies[0]["messages"][-1]["content"]] == \
            ["video_url", "text"]
        assert tab.foreign_requests() == [] and tab.errors == []
    finally:
        tab.page.evaluate("localStorage.clear()")
        tab.close()


def test_a_restarted_daemon_is_reported_and_the_conversation_goes_on(
        browser: Any, tmp_path: Path) -> None:
    """#49: after a daemon restart a follow-up silently lost its context."""
    from playwright.sync_api import expect

    d = HttpDaemon(tmp_path, args=["--set", "engine.default_max_tokens=8"]).start()
    tab = Page(browser, d)
    page = tab.page
    bodies = tab.chat_bodies()
    try:
        expect(page.locator("#model")).to_contain_text("context")
        tab.ask("What is the total on this receipt?", RECEIPT)
        tab.wait_answer()
        d.stop()
        d.start()
        tab.ask("And the date?")
        timings = tab.wait_answer()
        expect(page.locator("#notice")).to_contain_text("no longer held this conversation")
        expect(page.get_by_role("alert")).to_be_hidden()
        # The lost session was refused (409), then the history went again, picture included.
        assert [b["session_turns"] for b in bodies] == [0, 1, 0]
        assert bodies[2]["messages"][0]["content"][0]["type"] == "image_url"
        assert [m["role"] for m in bodies[2]["messages"]] == ["user", "assistant", "user"]
        assert prompt_tokens(timings) > 100
        assert "session_lost" in d.log() or "outcome=session_lost" in d.log()
        assert tab.errors == []
    finally:
        tab.close()
        d.stop()


def test_the_page_has_no_serious_accessibility_violations(browser: Any,
                                                          daemon: HttpDaemon) -> None:
    """axe-core (vendored in tests/vendor, evaluated over CDP: the page's CSP is not
    loosened) on the page with a conversation, its settings and the list shown."""
    from playwright.sync_api import expect

    axe = (Path(__file__).parent / "vendor" / "axe-core" / "axe.min.js").read_text()
    tab = Page(browser, daemon)
    page = tab.page
    try:
        expect(page.locator("#model")).to_contain_text("context")
        tab.ask("What is the total on this receipt?", RECEIPT)
        tab.wait_answer()
        page.get_by_text("Settings").click()
        page.evaluate(axe)
        for width in (900, 380):
            page.set_viewport_size({"width": width, "height": 800})
            if width == 380:
                page.get_by_role("button", name="Conversations").click()
            result = page.evaluate("axe.run(document, {resultTypes: ['violations']})")
            serious = [(v["id"], v["impact"], [n["target"] for n in v["nodes"]])
                       for v in result["violations"] if v["impact"] in ("serious", "critical")]
            assert serious == [], serious
        # Keyboard only: Tab reaches the question box and Send, Enter sends.
        page.set_viewport_size({"width": 900, "height": 800})
        page.locator("#question").focus()
        page.keyboard.type("And the date?")
        page.keyboard.press("Enter")
        tab.wait_answer()
        expect(page.locator(".turn")).to_have_count(2)
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
        kept = page.evaluate("JSON.stringify(Object.entries(localStorage))")
        assert key not in kept  # the conversation's id is kept there, never the key
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
