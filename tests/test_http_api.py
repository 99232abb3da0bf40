"""What OpenAI clients send and browsers need, against the real daemon over HTTP: large
max_tokens clamped, the current OpenAI fields accepted, a prompt over the context named
the way clients look for it, CORS for the listed origins only, and images as on the
socket (BMP, the decode-pixel limit by its key)."""

from __future__ import annotations

import base64
import io
import json
import re
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.conftest import wait_for
from tests.test_http import RECEIPT, HttpDaemon

ORIGIN = "http://localhost:3000"
HI = [{"role": "user", "content": "Hi"}]


CLIP_PIXELS = 1_000_000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("http-api"), args=[
        "--set", f'http.cors_allow_origins=["{ORIGIN}"]', "--set", "engine.max_new_tokens=16",
        "--set", "engine.default_max_tokens=8",
        # The bundled clip (20 frames of 96x64) within; 200 such frames past it.
        "--set", f"engine.max_clip_decode_pixels={CLIP_PIXELS}"]).start()
    try:
        yield d
    finally:
        d.stop()


def test_max_tokens_above_the_cap_are_clamped_and_say_length(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    answer = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=HI, max_completion_tokens=1000, temperature=0,
        extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16  # engine.max_new_tokens
    assert answer.choices[0].finish_reason == "length"
    legacy = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=HI, max_tokens=4096, temperature=0)
    assert legacy.usage.completion_tokens <= 16


def test_the_fields_current_clients_send_are_accepted(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    answer = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=HI, max_tokens=2, metadata={"job": "nightly"}, store=False,
        prompt_cache_key="greeting", safety_identifier="user-7", service_tier="auto",
        parallel_tool_calls=True, extra_body={"verbosity": "low"})
    assert answer.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as wrong:
        client.chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=HI, metadata={"job": 7})
    assert wrong.value.param == "metadata"
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=HI, extra_body={"temprature": 0})
    assert unknown.value.param == "temprature" and "temperature" in unknown.value.message


def test_a_prompt_over_the_context_is_context_length_exceeded(daemon: HttpDaemon) -> None:
    with pytest.raises(openai.BadRequestError) as long:
        daemon.openai().chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=[{"role": "user", "content": "word " * 20_000}])
    assert long.value.code == "context_length_exceeded"
    message = long.value.message
    # The true limit and what sets it: the tiny model's 4096 positions, below the key.
    assert "4096" in message and "max_position_embeddings" in message, message
    assert "engine.max_context_tokens is 8192" in message


def test_cors_answers_the_listed_origin_only(daemon: HttpDaemon) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = daemon.request("OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 204 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    status, headers, _ = daemon.request(
        "OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.test"})
    assert status == 405 and "Access-Control-Allow-Origin" not in headers
    status, headers, _ = daemon.request("GET", "/v1/models", headers={"Origin": ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "Origin" in headers["Vary"]
    status, headers, body = daemon.request("GET", "/v1/models",
                                           headers={"Origin": "http://evil.test"})
    # Keyless: another origin's page is refused outright (it would act as its visitor).
    assert status == 403 and "Access-Control-Allow-Origin" not in headers
    assert body["error"]["code"] == "forbidden"
    status, headers, body = daemon.request(  # an error is readable by the page too
        "POST", "/v1/chat/completions", b"{}",
        {"Origin": ORIGIN, "Content-Type": "application/json"})
    assert status == 400 and headers["Access-Control-Allow-Origin"] == ORIGIN
    assert body["error"]["param"] == "messages"


def test_a_wildcard_origin_is_refused_at_load(daemon: HttpDaemon) -> None:
    from qvld.config import ConfigError
    from qvld.config_loading import load_config

    with pytest.raises(ConfigError, match="list the origins"):
        load_config(None, ['http.cors_allow_origins=["*"]'])
    with pytest.raises(ConfigError, match="no wildcard"):  # it could never match
        load_config(None, ['http.cors_allow_origins=["http://*.example"]'])


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (its pixels never arrive)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b""))


def ask_image(daemon: HttpDaemon, data: bytes, kind: str) -> Any:
    url = f"data:image/{kind};base64," + base64.b64encode(data).decode()
    return daemon.openai().chat.completions.create(  # type: ignore[call-overload]
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is this?"}]}])


def test_images_are_the_same_on_both_fronts(daemon: HttpDaemon) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(RECEIPT).convert("RGB").save(buf, "BMP")
    answer = ask_image(daemon, buf.getvalue(), "bmp")
    assert answer.usage.completion_tokens == 2
    assert answer.usage.prompt_tokens > 20  # the image's tokens are in the prompt
    with pytest.raises(openai.BadRequestError) as bomb:
        ask_image(daemon, png_declaring(20_000, 20_000), "png")
    assert bomb.value.code == "image_too_large"
    assert "engine.max_decode_pixels" in bomb.value.message
    assert "decompression" not in bomb.value.message.lower()  # not Pillow's words


def test_http_users_are_shown_by_their_key_name(tmp_path_factory: pytest.TempPathFactory
                                                ) -> None:
    from qvld.http.keys import hash_key

    workdir = tmp_path_factory.mktemp("named")
    key = "qvld-test-key-carol-0123456789"
    keys = workdir / "keys"
    keys.write_text(f"carol:{hash_key(key)}\n")
    keys.chmod(0o600)
    d = HttpDaemon(workdir, args=["--set", f"http.api_keys_file={keys}"]).start()
    try:
        d.openai(key).chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=HI, max_tokens=2, extra_headers={"X-Qvld-Session": "c1"})
        with pytest.raises(openai.BadRequestError):
            d.openai(key).chat.completions.create(  # type: ignore[call-overload]
                model="tiny", messages=HI, max_tokens=0)
        out = d.qvlctl("sessions", "--all", "--json")
        assert out.returncode == 0, out.stderr
        assert [s["user"] for s in json.loads(out.stdout)] == ["carol"]
        with d.client() as client:
            status = client.status()
        assert any(e.get("user") == "carol" for e in status["last_errors"])
        text = d.qvlctl("status").stdout.decode()
        assert "carol" in text and "4294967296" not in text
    finally:
        d.stop()


def test_logprobs_one_entry_per_token_streamed_or_not(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    ask: dict[str, Any] = {"model": "tiny", "messages": HI, "max_tokens": 8,
                           "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = client.chat.completions.create(**ask)
    answer = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
    assert answer.choices[0].message.content == plain.choices[0].message.content
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 8
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob >= entry.logprob
    chunks = list(client.chat.completions.create(**ask, logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs 0: none beside
    with pytest.raises(openai.BadRequestError) as alone:
        client.chat.completions.create(**{**ask, "top_logprobs": 2})
    assert alone.value.param == "top_logprobs"


def test_logprobs_on_the_socket_in_the_result_and_each_token_event(daemon: HttpDaemon
                                                                   ) -> None:
    with daemon.client() as client:
        client.send({"id": 1, "op": "generate", "params": {
            "messages": HI, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": True}})
        events, reply = [], None
        while reply is None:
            message = client.receive()
            if message.get("event") == "token":
                events.append(message)
            else:
                reply = message
    result = reply["result"]
    assert len(result["logprobs"]) == result["usage"]["completion_tokens"] == 6
    assert [e["token_id"] for e in result["logprobs"]] == result["token_ids"]
    assert [e for event in events for e in event["logprobs"]] == result["logprobs"]
    assert all(len(e["top"]) == 1 for e in result["logprobs"])


def test_min_p_and_chat_template_kwargs_are_applied(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    image = "data:image/png;base64," + base64.b64encode(png_declaring_real(32, 32)).decode()
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                        {"type": "image_url", "image_url": {"url": image}},
                                        {"type": "text", "text": "Same?"}]}]
    plain = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=two, max_tokens=1)
    numbered = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=two, max_tokens=1,
        extra_body={"chat_template_kwargs": {"add_vision_id": True}, "min_p": 0.05})
    # "Picture 1: " and "Picture 2: " before the images, as Qwen's template writes them.
    assert numbered.usage.prompt_tokens > plain.usage.prompt_tokens + 4
    for extra in [{"chat_template_kwargs": {"messages": []}}, {"min_p": 2}]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(  # type: ignore[call-overload]
                model="tiny", messages=HI, extra_body=extra)
        assert refused.value.code == "bad_request"
        assert next(iter(extra)) in refused.value.message


def png_declaring_real(width: int, height: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, "PNG")
    return out.getvalue()


def test_legacy_engine_completions_name_the_chat_endpoint(daemon: HttpDaemon) -> None:
    status, _, body = daemon.request("POST", "/v1/engines/completions",
                                     b'{"prompt": "Hi"}')
    assert status == 404 and "/v1/chat/completions" in body["error"]["message"]


def test_n_gives_that_many_choices_streamed_or_not(daemon: HttpDaemon) -> None:
    client = daemon.openai()
    ask: dict[str, Any] = {"model": "tiny", "messages": HI, "max_tokens": 6, "n": 2,
                           "temperature": 1.0, "seed": 3, "extra_body": {"ignore_eos": True}}
    answer = client.chat.completions.create(**ask)
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.finish_reason == "length" and c.message.content for c in answer.choices)
    assert answer.usage.completion_tokens == 12  # both choices count
    one = client.chat.completions.create(**{**ask, "n": 1, "seed": 4})
    # Choice 1 is sampled with the seed + 1.
    assert answer.choices[1].message.content == one.choices[0].message.content
    chunks = list(client.chat.completions.create(**ask, stream=True))
    texts = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in answer.choices}
    assert finishes == {0: "length", 1: "length"}
    with daemon.client() as socket_client:
        socket_client.send({"id": 1, "op": "generate", "params": {
            "messages": HI, "max_tokens": 3, "n": 2, "ignore_eos": True, "stream": True}})
        indexes, reply = [], None
        while reply is None:
            message = socket_client.receive()
            if message.get("event") == "token":
                indexes.append(message["index"])
            else:
                reply = message
    assert sorted(set(indexes)) == [0, 1]
    result = reply["result"]
    assert [len(c["token_ids"]) for c in result["choices"]] == [3, 3]
    assert result["usage"]["completion_tokens"] == 6


def test_the_web_page_is_served_with_a_strict_policy_and_cached(daemon: HttpDaemon) -> None:
    status, headers, body = daemon.request("GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert 'role="alert"' in body and 'role="status"' in body and "/ui/app.js" in body
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy
    assert "connect-src 'self'" in policy and "unsafe" not in policy
    assert headers["X-Content-Type-Options"] == "nosniff"
    again, cached, _ = daemon.request("GET", "/", headers={"If-None-Match": headers["ETag"]})
    assert again == 304 and cached["ETag"] == headers["ETag"]
    total = len(body.encode())
    for name, kind in [("app.js", "text/javascript"), ("markdown.js", "text/javascript"),
                       ("store.js", "text/javascript"), ("clip.js", "text/javascript"),
                       ("app.css", "text/css"),
                       ("icon.svg", "image/svg+xml")]:
        status, headers, asset = daemon.request("GET", f"/ui/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind), name
        total += len(asset.encode())
        # Nothing from another origin (an SVG names its XML namespace, loading nothing).
        assert not re.search(r"https?://", asset.replace('xmlns="http://www.w3.org/2000/svg"',
                                                         "")), name
    assert total < 64 * 1024  # a few tens of KB
    assert daemon.request("GET", "/ui/../qvld.yaml")[0] == 404
    assert daemon.request("GET", "/ui/nothing.js")[0] == 404
    # What a browser asks for whatever the page links is the page's icon, logged as
    # the web page's (it was a 404 under op="unknown").
    status, headers, _ = daemon.request("GET", "/favicon.ico")
    assert status == 200 and headers["Content-Type"] == "image/svg+xml"
    wait_for(lambda: "GET /favicon.ico user=- op=web outcome=ok" in daemon.log(), 10,
             "the icon's request logged as the page's")


def test_a_clip_through_qvlctl_and_http_video_url(daemon: HttpDaemon, tmp_path: Any) -> None:
    from tests.conftest import TINY

    clip = TINY / "images" / "clip.mp4"  # H.264 in MP4, 2 s
    asked = daemon.qvlctl("ask", str(clip), "What happens in this clip?", "--json",
                          "--max-tokens", "4", "--temperature", "0")
    assert asked.returncode == 0, asked.stderr
    result = json.loads(asked.stdout)
    alone = json.loads(daemon.qvlctl("ask", "What happens in this clip?", "--json",
                                     "--max-tokens", "4").stdout)
    assert result["usage"]["prompt_tokens"] > alone["usage"]["prompt_tokens"] + 50
    url = "data:video/mp4;base64," + base64.b64encode(clip.read_bytes()).decode()
    answer = daemon.openai().chat.completions.create(  # type: ignore[call-overload]
        model="tiny", max_tokens=4, temperature=0, messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": "What happens in this clip?"}]}])
    assert answer.usage.prompt_tokens == result["usage"]["prompt_tokens"]
    assert answer.choices[0].message.content == result["text"]
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(clip.read_bytes()[: clip.stat().st_size // 2])
    refused = daemon.qvlctl("ask", str(cut), "What happens?")
    assert refused.returncode == 4 and b"video_invalid" in refused.stderr + refused.stdout
    with pytest.raises(openai.BadRequestError) as bad:
        daemon.openai().chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {
                    "url": "data:video/mp4;base64," + base64.b64encode(
                        cut.read_bytes()).decode()}}, {"type": "text", "text": "?"}]}])
    assert bad.value.code == "video_invalid"
    again = daemon.qvlctl("ask", "Still there?", "--max-tokens", "2")
    assert again.returncode == 0


def test_a_clip_past_what_decoding_may_cost_is_refused_and_the_bound_stated(
        daemon: HttpDaemon) -> None:
    """``engine.max_clip_decode_pixels`` (it was a constant): a clip whose frames up to
    the last sampled one would take more pixels to decode is refused from its header,
    naming the key; ``/v1/models`` states the clip bounds (the web page checks them)."""
    from qvld.config import EngineConfig
    from tests.engine.test_video import make_clip

    listed = daemon.openai().models.list().data[0].model_extra or {}
    assert listed["clip_limits"] == {"max_frame_pixels": EngineConfig().max_decode_pixels,
                                     "max_decoded_pixels": CLIP_PIXELS,
                                     "max_frames": 432_000}
    long = make_clip(seconds=20, fps=10, width=96, height=64)  # 200 frames
    with pytest.raises(openai.BadRequestError) as refused:
        daemon.openai().chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {
                    "url": "data:video/mp4;base64," + base64.b64encode(long).decode()}},
                {"type": "text", "text": "?"}]}])
    assert refused.value.code == "video_invalid"
    assert refused.value.body["message"] == (  # type: ignore[index]
        "the video would have 200 frames of 96x64 decoded (1,228,800 pixels); at most "
        "1,000,000 are decoded for one clip (engine.max_clip_decode_pixels): send a "
        "shorter or smaller one")
    short = make_clip(seconds=2, fps=10, width=96, height=64)
    answer = daemon.openai().chat.completions.create(  # type: ignore[call-overload]
        model="tiny", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {
                "url": "data:video/mp4;base64," + base64.b64encode(short).decode()}},
            {"type": "text", "text": "?"}]}])
    assert answer.usage.completion_tokens == 1


def test_what_vllm_llama_server_and_ollama_accept_is_accepted(daemon: HttpDaemon) -> None:
    """#47: one such field from a client or UI failed the whole request. Now
    ``reasoning_effort``, ``keep_alive``, ``cache_prompt`` are accepted (they ask for
    nothing here) and ``n_predict`` is max_tokens (-1: none)."""
    client = daemon.openai()
    answer = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=HI, reasoning_effort="low", temperature=0,
        extra_body={"keep_alive": "5m", "cache_prompt": True, "n_predict": 3,
                    "ignore_eos": True})
    assert answer.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as disagree:
        client.chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=HI, max_tokens=2, extra_body={"n_predict": 3})
    assert "disagree" in disagree.value.message


def test_logit_bias_offsets_the_logits(daemon: HttpDaemon) -> None:
    """``logit_bias`` (it was refused unless empty) is added to the named tokens' logits
    before anything else: +100 makes a token certain, -100 rules it out."""
    client = daemon.openai()

    def tokens(**kw: Any) -> list[str]:
        answer = client.chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=HI, max_tokens=4, temperature=0, logprobs=True,
            extra_body={"ignore_eos": True}, **kw)
        return [entry.token for entry in answer.choices[0].logprobs.content]

    greedy = tokens()
    forced = tokens(logit_bias={"400": 100})
    assert len(set(forced)) == 1 and forced != greedy
    other = tokens(logit_bias={"401": 100})
    assert len(set(other)) == 1 and other[0] != forced[0]
    # Both raised, one ruled out again: only the other comes.
    assert tokens(logit_bias={"400": -100, "401": 100}) == other
    assert tokens() == greedy  # a bias is the request's own
    with pytest.raises(openai.BadRequestError, match="beyond the vocabulary"):
        tokens(logit_bias={"999999999": 5})
    with pytest.raises(openai.BadRequestError, match="within"):
        tokens(logit_bias={"400": 500})
