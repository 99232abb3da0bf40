"""The OpenAI-compatible HTTP API, against the real qvld process on the tiny model, with
the real `openai` client (as users' applications call it) and plain HTTP."""

from __future__ import annotations

import base64
import http.client
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from qvld.http.keys import hash_key
from tests.conftest import TINY, Daemon, free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
RECEIPT = ROOT / "examples" / "receipt.png"
DATA_URL = "data:image/png;base64," + base64.b64encode(RECEIPT.read_bytes()).decode()
QUESTION = "What is the total?"


def image_messages(url: str = DATA_URL, detail: str = "auto") -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You read receipts."},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url, "detail": detail}},
                {"type": "text", "text": QUESTION}]}]


class HttpDaemon(Daemon):
    def __init__(self, workdir: Path, args: Sequence[str] = (), **kwargs: Any) -> None:
        self.port = free_port()
        super().__init__(workdir, args=["--set", f"http.listen=127.0.0.1:{self.port}",
                                        *args], **kwargs)

    def openai(self, key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key,
                             max_retries=0, timeout=60, **kwargs)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        if body is not None:  # what every HTTP client of a JSON API sends
            headers = {"Content-Type": "application/json", **(headers or {})}
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            data = response.read()
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = data.decode(errors="replace")
            return response.status, dict(response.getheaders()), parsed
        finally:
            conn.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    # One generation at a time: the disconnect test watches the slot come free.
    d = HttpDaemon(tmp_path_factory.mktemp("http"),
                   args=["--set", "engine.infer_requests=1",
                         "--set", "engine.max_sequences=1", "--set", "http.web_ui=false"]
                   ).start()
    try:
        yield d
    finally:
        d.stop()


def qvlctl_ask(daemon: Daemon, messages_file: Path, *flags: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "qvlctl.cli", "--socket", str(daemon.socket),
                          "ask", "--messages", str(messages_file), "--json", *flags],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_openai_client_answers_like_qvlctl_ask(daemon: HttpDaemon, tmp_path: Path) -> None:
    """The same messages through HTTP (non-streamed and streamed) and through the socket
    (qvlctl ask): greedy text equal token for token, usage equal."""
    client = daemon.openai()
    answer = client.chat.completions.create(model="tiny", messages=image_messages(),  # type: ignore[arg-type]
                                            max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=image_messages(), max_tokens=12, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True}))
    messages_file = tmp_path / "messages.json"
    messages_file.write_text(json.dumps([
        {"role": "system", "content": "You read receipts."},
        {"role": "user", "content": [{"type": "image", "image": str(RECEIPT)},
                                     {"type": "text", "text": QUESTION}]}]))
    socket_answer = qvlctl_ask(daemon, messages_file, "--max-tokens", "12",
                               "--temperature", "0")

    text = answer.choices[0].message.content
    assert text and text == socket_answer["text"]
    assert answer.object == "chat.completion" and answer.model == "tiny"
    assert answer.choices[0].finish_reason == socket_answer["finish_reason"]
    usage, v1 = answer.usage, socket_answer["usage"]
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (v1["prompt_tokens"],
                                                              v1["completion_tokens"])
    assert usage.total_tokens == v1["prompt_tokens"] + v1["completion_tokens"]
    details = usage.prompt_tokens_details
    assert details is not None
    assert details.model_dump()["image_tokens"] == v1["image_tokens"] > 0
    # Streamed: a role chunk, the text in deltas, a finish chunk, then the usage chunk.
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == socket_answer["finish_reason"] and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == v1["completion_tokens"]
    assert chunks[-1].usage.prompt_tokens == v1["prompt_tokens"]
    assert len({c.id for c in chunks}) == 1


def test_errors_raise_the_clients_error_classes(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as n2:
        client.chat.completions.create(model="tiny", messages=hi, n=17)  # type: ignore[arg-type]
    assert n2.value.status_code == 400 and n2.value.param == "n"
    assert n2.value.code == "bad_request"
    broken = "data:image/png;base64," + base64.b64encode(
        RECEIPT.read_bytes()[:200]).decode()  # a PNG cut short: the header, no pixels
    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(model="tiny", messages=image_messages(broken))  # type: ignore[arg-type]
    assert image.value.code == "image_invalid"
    not_an_image = "data:image/png;base64," + base64.b64encode(b"hello").decode()
    with pytest.raises(openai.BadRequestError) as garbage:
        client.chat.completions.create(model="tiny", messages=image_messages(not_an_image))  # type: ignore[arg-type]
    assert garbage.value.code == "image_invalid"
    with pytest.raises(openai.BadRequestError) as url:
        client.chat.completions.create(
            model="tiny", messages=image_messages("https://example.com/receipt.png"))  # type: ignore[arg-type]
    assert "fetch_image_urls" in url.value.message
    with pytest.raises(openai.BadRequestError) as none:
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=0)  # type: ignore[arg-type]
    assert "max_tokens" in none.value.message
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model="tiny", messages=hi, tools=[{  # type: ignore[arg-type]
            "type": "function", "function": {"name": "no spaces", "parameters": {}}}])
    assert tools.value.param == "tools"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    # Still serving after each.
    ok = client.chat.completions.create(model="tiny", messages=hi, max_tokens=2)  # type: ignore[arg-type]
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def test_models_and_health(daemon: HttpDaemon) -> None:
    models = daemon.openai().models.list().data
    assert [m.id for m in models] == ["tiny"]
    extra = models[0].model_extra or {}
    assert extra["input_modalities"] == ["text", "image", "video"]
    assert extra["context_length"] > 0
    assert extra["runtime"].startswith("openvino ")
    status, _, body = daemon.request("GET", "/health")
    assert status == 200 and body == {"status": "ready", "ready": True}


def test_low_detail_images_cost_fewer_tokens(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    low = client.chat.completions.create(model="tiny", messages=image_messages(detail="low"),  # type: ignore[arg-type]
                                         max_tokens=1)
    auto = client.chat.completions.create(model="tiny", messages=image_messages(),  # type: ignore[arg-type]
                                          max_tokens=1)
    assert low.usage is not None and auto.usage is not None
    low_images = low.usage.prompt_tokens_details.model_dump()["image_tokens"]  # type: ignore[union-attr]
    auto_images = auto.usage.prompt_tokens_details.model_dump()["image_tokens"]  # type: ignore[union-attr]
    assert 0 < low_images <= 64 < auto_images


def test_session_header_reuses_the_conversation(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    first_turn = [{"role": "system", "content": "You answer briefly. " * 12},
                  {"role": "user", "content": "Name three colours."}]
    first = client.chat.completions.create(
        model="tiny", messages=first_turn, max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_headers={"X-Qvld-Session": "chat-1"})
    assert (first.model_extra or {})["session"]["id"] == "chat-1"
    # As a protocol v1 session: the follow-up sends only what is new; the daemon holds
    # the exact history (the generated ids) and its KV cache.
    second = client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0, extra_headers={"X-Qvld-Session": "chat-1"},
        messages=[{"role": "user", "content": "And two more?"}])
    assert (second.model_extra or {})["session"] == {"id": "chat-1", "turns": 2,
                                                     "reset": False}
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    history = first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.usage.prompt_tokens > history
    # Whole KV blocks of 32 rows are reused (all of it on a slot of its own).
    assert history >= 64 and details.cached_tokens >= history // 32 * 32
    # A page that holds 1 turn where the daemon holds 2 is told, in a typed 409.
    status, _, body = daemon.request(
        "POST", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "Hi"}], "session_turns": 1}).encode(),
        {"X-Qvld-Session": "chat-1", "Content-Type": "application/json"})
    assert status == 409 and body["error"]["code"] == "session_lost", body
    # A header that is not a session id is refused, naming the header.
    status, _, body = daemon.request(
        "POST", "/v1/chat/completions", json.dumps({"messages": first_turn}).encode(),
        {"X-Qvld-Session": "a b", "Content-Type": "application/json"})
    assert status == 400 and body["error"]["param"] == "X-Qvld-Session"


def test_a_disconnect_mid_stream_frees_the_slot(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Go on forever"}],  # type: ignore[arg-type]
        max_tokens=500, stream=True, extra_body={"ignore_eos": True})
    first = [next(iter(stream)) for _ in range(3)]
    assert first[0].choices[0].delta.role == "assistant"
    assert daemon.queue() == (1, 0)
    stream.close()  # the client leaves
    daemon.wait_queue(0, 0, timeout=30)
    wait_for(lambda: "op=generate outcome=cancelled" in daemon.log(), 10,
             "the cancelled generation in the log", detail=daemon.log)
    # The only slot serves the next request.
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user",  # type: ignore[arg-type]
                                                                 "content": "Hi"}],
                                        max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def test_a_disconnect_while_waiting_for_a_whole_answer_frees_the_slot(
        daemon: HttpDaemon) -> None:
    import socket

    body = json.dumps({"messages": [{"role": "user", "content": "Go on"}],
                       "max_tokens": 500, "ignore_eos": True}).encode()
    cancelled = daemon.log().count("op=generate outcome=cancelled")
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        daemon.wait_queue(1, 0)
    daemon.wait_queue(0, 0)  # closed: cancelled within a step, not run to 500 tokens
    wait_for(lambda: daemon.log().count("op=generate outcome=cancelled") == cancelled + 1,
             10, "the cancelled generation in the log", detail=daemon.log)


def test_requests_are_counted_by_api(daemon: HttpDaemon) -> None:
    from tests.conftest import Samples

    def samples() -> Samples:
        from prometheus_client.parser import text_string_to_metric_families

        status, _, text = daemon.request("GET", "/metrics")
        assert status == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def count(s: Samples, api: str, outcome: str) -> float:
        return s.get(("qvld_requests_total", (("api", api), ("op", "generate"),
                                              ("outcome", outcome))), 0.0)

    before = samples()
    daemon.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)  # type: ignore[arg-type]
    with daemon.client() as socket_client:
        socket_client.generate({"messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 2})
    daemon.request("POST", "/v1/chat/completions", b"{", {})
    after = samples()
    assert count(after, "http", "ok") - count(before, "http", "ok") == 1
    assert count(after, "socket", "ok") - count(before, "socket", "ok") == 1
    assert count(after, "http", "bad_request") - count(before, "http", "bad_request") == 1
    generated = ("qvld_generated_tokens_total", ())
    assert after[generated] - before[generated] == 4  # the same histograms and counters


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpDaemon, str]]:
    workdir = tmp_path_factory.mktemp("keyed")
    key = "qvld-test-key-alice-0123456789"
    keys_file = workdir / "keys"
    keys_file.write_text(f"# test keys\nalice:{hash_key(key)}\n")
    keys_file.chmod(0o600)
    # One generation at a time and no queue: a second request at once is busy (429).
    d = HttpDaemon(workdir, args=["--set", f"http.api_keys_file={keys_file}",
                                  "--set", "engine.infer_requests=1",
                                  "--set", "engine.max_sequences=1",
                                  "--set", "server.queue_max=0"]).start()
    try:
        yield d, key
    finally:
        d.stop()


def test_api_keys_name_users_and_wrong_keys_get_401(keyed: tuple[HttpDaemon, str]) -> None:
    daemon, key = keyed
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.AuthenticationError) as wrong:
        daemon.openai("qvld-wrong").chat.completions.create(model="tiny", messages=hi)  # type: ignore[arg-type]
    assert wrong.value.status_code == 401
    status, headers, body = daemon.request("GET", "/v1/models")  # no key at all
    assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
    assert body["error"]["code"] == "invalid_api_key"
    answer = daemon.openai(key).chat.completions.create(model="tiny", messages=hi,  # type: ignore[arg-type]
                                                        max_tokens=2)
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    assert "user=alice op=generate outcome=ok" in daemon.log()
    # Health answers load balancers without a key.
    assert daemon.request("GET", "/health")[0] == 200


def test_busy_is_429_with_retry_after(keyed: tuple[HttpDaemon, str]) -> None:
    daemon, key = keyed
    client = daemon.openai(key)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Go on"}],  # type: ignore[arg-type]
        max_tokens=500, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as busy:
            client.chat.completions.create(model="tiny", messages=[  # type: ignore[arg-type]
                {"role": "user", "content": "Hi"}], max_tokens=2)
        assert busy.value.code == "busy"
        assert busy.value.response.headers["Retry-After"] == "1"
    finally:
        stream.close()
    daemon.wait_queue(0, 0)


def test_a_sighup_reloads_the_keys(keyed: tuple[HttpDaemon, str]) -> None:
    daemon, key = keyed
    keys_file = Path(daemon.workdir) / "keys"
    bob = "qvld-test-key-bob-9876543210"
    keys_file.write_text(f"bob:{hash_key(bob)}\n")
    assert daemon.proc is not None
    daemon.proc.send_signal(1)  # SIGHUP
    wait_for(lambda: "reload done" in daemon.log(), 60, "the reload", detail=daemon.log)
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.AuthenticationError):
        daemon.openai(key).chat.completions.create(model="tiny", messages=hi)  # type: ignore[arg-type]
    answer = daemon.openai(bob).chat.completions.create(model="tiny", messages=hi,  # type: ignore[arg-type]
                                                        max_tokens=1)
    assert answer.choices[0].finish_reason == "length"
    # A broken keys file fails the reload and keeps the keys in force.
    keys_file.write_text("carol:not-a-hash\n")
    daemon.proc.send_signal(1)
    wait_for(lambda: "reload failed" in daemon.log(), 60, "the failed reload",
             detail=daemon.log)
    assert daemon.openai(bob).models.list().data[0].id == "tiny"


class ImageServer:
    """A plain HTTP server with the receipt, for the fetcher to fetch from."""

    def __init__(self, directory: Path) -> None:
        import functools
        import http.server
        import threading

        handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                    directory=str(directory))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_health_while_loading_then_image_urls_when_allowed(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "receipt.png").write_bytes(RECEIPT.read_bytes())
    (site / "notes.txt").write_text("not an image")
    (site / "clip.mp4").write_bytes((TINY / "images" / "clip.mp4").read_bytes())
    images = ImageServer(site)
    (tmp_path / "daemon").mkdir()
    d = HttpDaemon(tmp_path / "daemon", args=[
        "--set", "http.fetch_image_urls=true", "--set", "http.fetch_allow_hosts=[127.0.0.1]",
        "--set", "http.fetch_allow_private=[127.0.0.1]"])
    d.start(wait_ready=False)
    try:
        seen: list[tuple[int, Any]] = []

        def health() -> bool:
            try:
                status, _, body = d.request("GET", "/health")
            except OSError:
                return False  # not listening yet
            seen.append((status, body))
            return status == 200

        wait_for(health, 60, "the daemon to become ready", detail=d.log)
        # The listener answers before the model is loaded: a probe reads "not yet".
        assert seen[0] == (503, {"status": "loading", "ready": False}), seen[:3]
        assert seen[-1] == (200, {"status": "ready", "ready": True})
        client = d.openai()
        base = f"http://127.0.0.1:{images.port}"
        fetched = client.chat.completions.create(
            model="tiny", messages=image_messages(f"{base}/receipt.png"), max_tokens=4,  # type: ignore[arg-type]
            temperature=0)
        inline = client.chat.completions.create(
            model="tiny", messages=image_messages(), max_tokens=4, temperature=0)  # type: ignore[arg-type]
        assert fetched.choices[0].message.content == inline.choices[0].message.content
        assert fetched.usage is not None and inline.usage is not None
        assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens
        clip = client.chat.completions.create(  # a video URL, under the same rules
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": [  # type: ignore[arg-type]
                {"type": "video_url", "video_url": {"url": f"{base}/clip.mp4"}},
                {"type": "text", "text": "What happens?"}]}])
        assert clip.usage is not None and clip.usage.prompt_tokens > 60
        with pytest.raises(openai.PermissionDeniedError) as other_host:
            client.chat.completions.create(
                model="tiny", messages=image_messages(  # type: ignore[arg-type]
                    f"http://localhost:{images.port}/receipt.png"))
        assert "fetch_allow_hosts" in other_host.value.message
        with pytest.raises(openai.BadRequestError) as text:
            client.chat.completions.create(
                model="tiny", messages=image_messages(f"{base}/notes.txt"))  # type: ignore[arg-type]
        assert text.value.code == "image_invalid"
        with pytest.raises(openai.BadRequestError) as missing:
            client.chat.completions.create(
                model="tiny", messages=image_messages(f"{base}/nothing.png"))  # type: ignore[arg-type]
        # An internal host (in fetch_allow_private): the client reads the same words for
        # a text file and a 404 (no port scan through qvld); the log says which.
        assert missing.value.code == "image_invalid"
        assert missing.value.message == text.value.message
        assert "404" not in missing.value.message
        assert "127.0.0.1 (in http.fetch_allow_private) failed: could not fetch image URL " \
            "127.0.0.1: HTTP 404" in d.log()
    finally:
        d.stop()
        images.close()


def test_a_drain_ends_a_stream_with_an_error_event(tmp_path: Path) -> None:
    """SIGTERM with no time to finish: a running stream is told why it ended (the openai
    client raises), instead of a cut-off that looks like a finished answer."""
    import signal

    d = HttpDaemon(tmp_path, args=["--set", "server.drain_timeout_s=0"]).start()
    try:
        stream = d.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Go on"}],  # type: ignore[arg-type]
            max_tokens=500, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
    finally:
        assert d.stop() == 0


def test_the_web_page_can_be_turned_off(daemon: HttpDaemon) -> None:
    status, _, body = daemon.request("GET", "/")
    assert status == 404 and "http.web_ui is off" in body["error"]["message"]
    assert daemon.request("GET", "/ui/app.js")[0] == 404
    assert daemon.request("GET", "/health")[0] == 200
