"""Chat-completions bodies -> protocol v1 params, and the shapes of replies and errors."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from qvld.engine.inputs.request import parse_generate
from qvld.errors import BadRequest, Busy, ImageInvalid, QvlError, Timeout, Unavailable
from qvld.http import media, openai, openai_replies


def png(size: tuple[int, int] = (8, 8), kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, kind)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_a_full_request_maps_onto_generate_params() -> None:
    image = png()
    chat = openai.parse_chat(body(
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [
                      {"type": "text", "text": "What is this?"},
                      {"type": "image_url", "image_url": {"url": data_url(image)}}]},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": "And?", "name": "bob"}],
        max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="END",
        presence_penalty=0.1, frequency_penalty=0.2, n=1, user="u-1", stream=True,
        stream_options={"include_usage": True}, top_k=5, logprobs=False, tools=[]),
        session="s-1")
    assert chat.stream and chat.include_usage and chat.user == "u-1" and chat.model == "tiny"
    params = chat.params
    assert params["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                     {"type": "image", "image": image}]},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "And?"}]
    assert {k: params[k] for k in ("max_tokens", "temperature", "top_p", "seed", "stop",
                                   "presence_penalty", "frequency_penalty", "top_k",
                                   "session", "stream")} == {
        "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "END",
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "top_k": 5, "session": "s-1",
        "stream": True}
    request, stream = parse_generate(params)  # protocol v1's own parser takes them
    assert stream and request.stop == ["END"] and request.frequency_penalty == 0.2


@pytest.mark.parametrize("fields, param", [
    ({"n": 17}, "n"), ({"n": True}, "n"), ({"n": 0}, "n"), ({"tempreature": 1}, "tempreature"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21},
                                             "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": []}},
     "response_format.json_schema"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ({"model": 3}, "model"), ({"user": "x" * 300}, "user"), ({"stream": "yes"}, "stream"),
    ({"messages": []}, "messages"), ({"messages": "Hi"}, "messages"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "ftp://x/y.png"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,", "detail": "max"}}]}]},
     "messages[0].content[0].image_url.detail"),
])
def test_what_is_refused_names_its_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        openai.parse_chat(body(**fields))
    assert getattr(refused.value, "param", None) == param
    assert openai.error_body(refused.value)[1]["error"]["param"] == param


@pytest.mark.parametrize(("given", "wire"), [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "json_schema": {"name": "r", "strict": True,
                                             "schema": {"type": "integer"}}},
     {"type": "json_schema", "schema": {"type": "integer"}}),
    ({"type": "json_schema", "json_schema": {"name": "any", "description": "d"}},
     {"type": "json_object"}),  # OpenAI's schema is optional
    ({"type": "regex", "pattern": "[0-9]+"}, {"type": "regex", "pattern": "[0-9]+"}),
])
def test_openais_response_formats_become_protocol_v1s(given: Any, wire: Any) -> None:
    params = openai.parse_chat(body(response_format=given)).params
    assert params.get("response_format") == wire
    request, _ = parse_generate(params)
    assert (request.response_format is None) == (wire is None)


def test_unknown_field_gets_a_did_you_mean() -> None:
    with pytest.raises(BadRequest, match="did you mean 'max_tokens'"):
        openai.parse_chat(body(max_token=5))


@pytest.mark.parametrize("url", [
    "data:image/png;base64,@@@", "data:text/plain;base64,aGk=", "data:image/png,rawbytes",
    data_url(b"II*\x00 a TIFF, not a format we take"), data_url(b"\x89PNG"[:3]),
])
def test_data_urls_must_hold_base64_png_jpeg_webp_gif_or_bmp(url: str) -> None:
    with pytest.raises(ImageInvalid):
        media.data_url_bytes(url)


@pytest.mark.parametrize("kind, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                        ("WEBP", "image/webp"), ("GIF", "image/gif"),
                                        ("BMP", "image/bmp")])
def test_the_five_formats_are_taken(kind: str, mime: str) -> None:
    data = png(kind=kind)
    assert media.data_url_bytes(data_url(data, mime)) == data


def test_detail_low_asks_for_a_small_image_budget_unless_given() -> None:
    def image(detail: str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": data_url(png()), "detail": detail}}

    def budget(*parts: dict[str, Any], **fields: Any) -> Any:
        return openai.parse_chat(body(messages=[{"role": "user", "content": list(parts)}],
                                      **fields), low_detail_tokens=48).params.get(
            "max_image_tokens")

    assert budget(image("low")) == 48
    assert budget(image("low"), image("low")) == 48
    assert budget(image("low"), image("high")) is None  # the configured default
    assert budget(image("auto")) is None
    assert budget(image("low"), max_image_tokens=100) == 100


def test_remote_urls_are_left_for_the_caller() -> None:
    chat = openai.parse_chat(body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": "https://example.com/a.png"}]}]))
    assert [r.url for r in chat.remote_images] == ["https://example.com/a.png"]
    chat.remote_images[0].part["image"] = b"bytes"
    assert chat.params["messages"][0]["content"][0] == {"type": "image", "image": b"bytes"}


RESULT = {"text": "Total: 4", "token_ids": [1, 2, 3], "finish_reason": "length",
          "usage": {"prompt_tokens": 20, "completion_tokens": 3, "image_tokens": 16,
                    "cached_tokens": 4},
          "timings": {"ttft_s": 0.1}, "session": {"id": "s", "turns": 1, "reset": False}}


def test_replies_in_openais_shapes() -> None:
    done = openai_replies.completion(RESULT, "chatcmpl-1", 5, "tiny")
    assert done["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                        "content": "Total: 4"},
                                "finish_reason": "length", "logprobs": None}]
    assert done["usage"] == {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23,
                             "prompt_tokens_details": {"cached_tokens": 4,
                                                       "image_tokens": 16},
                             "completion_tokens_details": {"reasoning_tokens": 0,
                                                           "forced_tokens": 0}}
    assert done["session"]["id"] == "s" and done["timings"] == {"ttft_s": 0.1}
    part = openai_replies.chunk("chatcmpl-1", 5, "tiny", {"content": "To"})
    assert part["object"] == "chat.completion.chunk"
    assert part["choices"][0]["delta"] == {"content": "To"}
    last = openai_replies.usage_chunk(RESULT, "chatcmpl-1", 5, "tiny")
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 23


@pytest.mark.parametrize("exc, status, kind", [
    (BadRequest("x"), 400, "invalid_request_error"), (ImageInvalid("x"), 400,
                                                      "invalid_request_error"),
    (Busy("x"), 429, "rate_limit_error"), (Unavailable("x"), 503, "unavailable_error"),
    (Timeout("x"), 504, "timeout_error"), (QvlError("x"), 500, "server_error"),
])
def test_errors_carry_status_type_and_code(exc: QvlError, status: int, kind: str) -> None:
    got_status, shape = openai.error_body(exc)
    assert got_status == status
    assert shape == {"error": {"message": "x", "type": kind, "param": None,
                               "code": exc.code}}


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats()
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=10)
FIELDS = sorted(openai.FIELDS | set(openai.OFF_VALUES))


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from([*FIELDS, "other"]), JSON, max_size=6)
       | JSON)
def test_any_json_is_params_or_a_typed_error(value: Any) -> None:
    """Whatever a client sends, the translation and protocol v1's parser together end
    in params or a typed error, never anything else."""
    try:
        chat = openai.parse_chat(value)
        parse_generate(chat.params)
    except (BadRequest, ImageInvalid):
        pass
