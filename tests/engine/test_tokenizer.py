from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qvld.engine.model.model_dir import find_chat_template, load_model_spec
from qvld.engine.model.tokenizer import (
    ChatTemplate,
    IncrementalText,
    TextTokenizer,
    expand_image_pads,
)
from qvld.errors import BadRequest, ModelInvalid


def test_template_renders_parts_system_and_generation_prompt(tiny_dir: Path) -> None:
    spec = load_model_spec(tiny_dir, "openvino")
    template = ChatTemplate(spec.chat_template, spec.special_tokens)
    text = template.render([
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]},
    ])
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|image_pad|><|vision_end|>Q<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not template.render([{"role": "user", "content": "x"}],
                               add_generation_prompt=False).endswith("assistant\n")


def test_raise_exception_in_template_is_bad_request() -> None:
    template = ChatTemplate("{% if messages[0].role == 'tool' %}"
                            "{{ raise_exception('Unknown role: tool') }}{% endif %}")
    with pytest.raises(BadRequest, match="Unknown role"):
        template.render([{"role": "tool", "content": "x"}])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_the_real_template_shows_tools_calls_and_results(tiny_dir: Path) -> None:
    """Qwen3-VL-2B-Instruct's template (the fixture's) renders as transformers'
    ``apply_chat_template(messages, tools=...)`` does (checked against it when the
    template was added; the reference tier compares the token ids)."""
    spec = load_model_spec(tiny_dir, "openvino")
    template = ChatTemplate(spec.chat_template, spec.special_tokens)
    text = template.render([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C"}, {"role": "tool", "content": "sunny"},
    ], tools=[WEATHER])
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        "<tools></tools> XML tags:\n<tools>\n" + json.dumps(WEATHER) + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n"
        "sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_template_variables_reach_the_template(tiny_dir: Path) -> None:
    spec = load_model_spec(tiny_dir, "openvino")
    template = ChatTemplate(spec.chat_template, spec.special_tokens)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    numbered = template.render(messages, variables={"add_vision_id": True,
                                                    "messages": "ignored"})
    assert "Picture 1: <|vision_start|>" in numbered and "Picture 2: " in numbered
    assert "Picture" not in template.render(messages)


def test_template_features_transformers_provides() -> None:
    source = ("{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}"
              "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ eos_token }}"
              "{{ strftime_now('%Y') | length }}")
    template = ChatTemplate(source, {"eos_token": "</s>"})
    out = template.render([{"role": "user", "content": "é"}, {"role": "a", "content": "b"},
                           {"role": "c", "content": "d"}])
    assert out == '{"role": "user", "content": "é"}{"role": "a", "content": "b"}</s>4'


def test_template_cannot_escape_the_sandbox() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception):  # noqa: B017 - jinja2's SecurityError or our BadRequest
        template.render([{"role": "user", "content": "x"}])


def test_broken_template_is_model_invalid() -> None:
    with pytest.raises(ModelInvalid):
        ChatTemplate("{% for %}")


def test_template_lookup_order(tmp_path: Path) -> None:
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert find_chat_template(tmp_path, {"chat_template": "config"}) == "json"
    (tmp_path / "chat_template.jinja").write_text("jinja")
    assert find_chat_template(tmp_path, {"chat_template": "config"}) == "jinja"
    empty = tmp_path / "e"
    empty.mkdir()
    assert find_chat_template(empty, {"chat_template": "config"}) == "config"
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    assert find_chat_template(empty, {"chat_template": named}) == "d"
    with pytest.raises(ModelInvalid):
        find_chat_template(empty, {})


def test_expand_image_pads() -> None:
    assert expand_image_pads([1, 9, 2, 9], 9, [2, 3]) == ([1, 9, 9, 2, 9, 9, 9], [1, 4])
    with pytest.raises(BadRequest):
        expand_image_pads([1, 9, 9], 9, [2])
    with pytest.raises(BadRequest):
        expand_image_pads([1, 9], 9, [2, 2])


def test_incremental_text_never_releases_half_a_character(tiny_dir: Path) -> None:
    tok = TextTokenizer(tiny_dir / "tokenizer.json")
    ids = tok.encode("a𝄞b")  # a 4-byte character: byte-level BPE splits it
    assert tok.decode(ids) == "a𝄞b"
    text = IncrementalText(tok)
    released = []
    for token in ids:
        text.add(token)
        released.append(text.stable_text())
    assert all("\ufffd" not in r for r in released)
    assert released[-1] == "a𝄞b"
    assert len(ids) > 3  # the character really was split


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_incremental_text_equals_decoding_everything(tiny_dir: Path, data: st.DataObject) -> None:
    """At every step, whatever the ids (split characters, invalid bytes, special tokens)."""
    tok = TextTokenizer(tiny_dir / "tokenizer.json")
    vocab = tok.vocab_size
    samples = "héllo wörld 𝄞 日本語 ok\n" + "".join(chr(c) for c in range(0x1F600, 0x1F610))
    ids = data.draw(st.one_of(
        st.lists(st.integers(0, vocab - 1), max_size=40),
        st.text(alphabet=samples, max_size=30).map(tok.encode)))
    text = IncrementalText(tok)
    for i, token in enumerate(ids):
        text.add(token)
        assert text.text == tok.decode(ids[:i + 1])
        assert text.text[:text.settled_length] == tok.decode(ids[:i + 1])[:text.settled_length]


def test_model_spec_reads_ids_and_limits(tiny_dir: Path) -> None:
    spec = load_model_spec(tiny_dir, "openvino")
    config = json.loads((tiny_dir / "config.json").read_text())
    tok = TextTokenizer(tiny_dir / "tokenizer.json")
    assert spec.image_token_id == config["image_token_id"] == tok.token_id("<|image_pad|>")
    assert tok.token_id("<|im_end|>") in spec.generation.eos_token_ids
    assert spec.vision.patch_size == 16 and spec.vision.deepstack_layers == 2
    assert spec.vision.max_pixels == 256 * 32 * 32


@pytest.mark.parametrize("name", ["namespace", "range", "raise_exception", "dict"])
def test_template_variables_cannot_shadow_what_the_template_calls(name: str) -> None:
    """#46: chat_template_kwargs naming a template global (``namespace``) made the
    template crash: a 500 with a traceback. Refused when parsed, as a 400."""
    from qvld.engine.inputs.request import parse_generate

    with pytest.raises(BadRequest, match=f"cannot set '{name}'"):
        parse_generate({"messages": [{"role": "user", "content": "Hi"}],
                        "chat_template_kwargs": {name: "x"}})


def test_a_template_that_crashes_on_a_requests_values_is_a_bad_request() -> None:
    template = ChatTemplate("{{ messages[0]['content'] }}{{ depth + 1 }}")
    assert template.render([{"role": "user", "content": "Hi"}], variables={"depth": 1}) \
        == "Hi2"
    with pytest.raises(BadRequest, match="TypeError"):
        template.render([{"role": "user", "content": "Hi"}], variables={"depth": "deep"})
