"""The engine's text path on the committed tiny model, against transformers' ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import pytest

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest
from qvld.engine.inputs.request import parse_generate
from qvld.engine.model.openvino import slice_logits_to_last_position
from qvld.errors import BadRequest, ModelInvalid, PromptTooLong
from tests.conftest import TINY, load_reference, parity_config, with_image_bytes

CASES = load_reference(TINY)["cases"]
TEXT_CASES = [c for c in CASES if "image" not in json.dumps(c["messages"])]
IMAGE_CASES = [c for c in CASES if c not in TEXT_CASES]


def greedy(case: dict[str, Any], **kw: Any) -> GenerateRequest:
    return GenerateRequest(messages=with_image_bytes(case["messages"], TINY),
                           max_tokens=case["max_new_tokens"], temperature=0.0, **kw)


def test_reference_has_the_cases_the_issues_ask_for() -> None:
    assert len(TEXT_CASES) >= 6
    assert len(IMAGE_CASES) >= 12


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_prompt_ids_equal_transformers(tiny_engine: Engine, case: dict[str, Any]) -> None:
    ids, *_ = tiny_engine.tokenize(greedy(case))
    assert ids == case["input_ids"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_greedy_ids_equal_transformers(tiny_engine: Engine, case: dict[str, Any]) -> None:
    result = tiny_engine.generate(greedy(case))
    assert result.token_ids == case["token_ids"]
    assert result.usage.prompt_tokens == len(case["input_ids"])
    assert result.usage.completion_tokens == len(case["token_ids"])
    assert result.text == tiny_engine.tokenizer.decode(case["token_ids"])


def test_reference_covers_a_prompt_longer_than_one_chunk(tiny_engine: Engine) -> None:
    chunk = tiny_engine.config.engine.prefill_chunk
    assert max(len(c["input_ids"]) for c in CASES) > 3 * chunk


@pytest.mark.parametrize("name", ["longer_than_chunk", "two_images_one_message",
                                  "images_in_two_turns", "image_with_system"])
def test_chunk_size_does_not_change_ids(name: str) -> None:
    # Chunks of 7 split images across chunks: deepstack rows must follow their chunk.
    case = next(c for c in CASES if c["name"] == name)
    odd = Engine(parity_config(TINY, prefill_chunk=7, infer_requests=1))
    whole = Engine(parity_config(TINY, prefill_chunk=4096, infer_requests=1))
    assert odd.generate(greedy(case)).token_ids == case["token_ids"]
    assert whole.generate(greedy(case)).token_ids == case["token_ids"]


def test_lm_head_is_sliced_and_last_logits_unchanged(tiny_dir: Path) -> None:
    core = ov.Core()
    props = {"INFERENCE_PRECISION_HINT": "f32"}
    full_model = core.read_model(tiny_dir / "openvino_language_model.xml")
    sliced_model = core.read_model(tiny_dir / "openvino_language_model.xml")
    assert slice_logits_to_last_position(sliced_model)
    full = core.compile_model(full_model, "CPU", props).create_infer_request()
    sliced = core.compile_model(sliced_model, "CPU", props).create_infer_request()
    rng = np.random.default_rng(0)
    seq, hidden = 9, full_model.input("inputs_embeds").get_partial_shape()[2].get_length()
    inputs = {
        "inputs_embeds": rng.standard_normal((1, seq, hidden)).astype(np.float32),
        "attention_mask": np.ones((1, seq), np.int64),
        "position_ids": np.tile(np.arange(seq), (3, 1, 1)).astype(np.int64),
        "visual_pos_masks": np.zeros((1, seq), bool),
        "deepstack_visual_embeds": np.zeros((2, 1, hidden), np.float32),
        "beam_idx": np.zeros(1, np.int32),
    }
    a = full.infer(inputs)[0]
    b = sliced.infer(inputs)[0]
    assert a.shape[1] == seq and b.shape[1] == 1
    np.testing.assert_allclose(a[:, -1], b[:, -1], atol=1e-5)


def test_runtime_runs_the_requested_precisions(tiny_engine: Engine) -> None:
    props = tiny_engine.models.runtime_properties
    assert "f32" in props["INFERENCE_PRECISION_HINT"] or "float32" in props[
        "INFERENCE_PRECISION_HINT"]
    assert "f32" in props["KV_CACHE_PRECISION"] or "float32" in props["KV_CACHE_PRECISION"]


# -- sampling, stop rules, limits ---------------------------------------------------

MESSAGES = [{"role": "user", "content": "Describe the image."}]


def test_seeded_sampling_is_reproducible(tiny_engine: Engine) -> None:
    def sample(seed: int) -> list[int]:
        request = GenerateRequest(messages=MESSAGES, max_tokens=24, temperature=1.5,
                                  top_k=0, top_p=1.0, seed=seed)
        return tiny_engine.generate(request).token_ids

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    greedy_ids = tiny_engine.generate(
        GenerateRequest(messages=MESSAGES, max_tokens=24, temperature=0.0)).token_ids
    assert first != greedy_ids


def test_model_defaults_sample_when_temperature_is_omitted(tiny_engine: Engine) -> None:
    # The fixture's generation_config has do_sample: true, temperature 0.7, top_k 20.
    assert tiny_engine.spec.generation.do_sample
    params = tiny_engine.sampling_params(GenerateRequest(messages=MESSAGES))
    assert (params.temperature, params.top_k, params.top_p) == (0.7, 20, 0.8)
    runs = {tuple(tiny_engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=12,
                                                       seed=s)).token_ids) for s in range(4)}
    assert len(runs) > 1


def test_max_tokens_ends_with_length(tiny_engine: Engine) -> None:
    result = tiny_engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=5,
                                                  temperature=0.0))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 5


def test_stop_string_trims_text_and_ends_with_stop(tiny_engine: Engine) -> None:
    free = tiny_engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=24,
                                                temperature=0.0))
    text = free.text
    # A stop string that first appears somewhere in the middle of the greedy text.
    start = len(text) // 2
    stop = text[start:start + 3]
    cut = text.find(stop)
    result = tiny_engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=24,
                                                  temperature=0.0, stop=[stop]))
    assert result.finish_reason == "stop"
    assert result.text == text[:cut]
    assert result.token_ids == free.token_ids[:len(result.token_ids)]
    assert len(result.token_ids) < len(free.token_ids)
    assert stop in tiny_engine.tokenizer.decode(result.token_ids)


def test_eos_ends_with_stop_and_keeps_the_eos_id(tiny_engine: Engine) -> None:
    eos = set(tiny_engine.spec.generation.eos_token_ids)
    # Greedy runs of a random model rarely hit eos; sampling hot over many seeds does.
    for seed in range(200):
        result = tiny_engine.generate(GenerateRequest(
            messages=MESSAGES, max_tokens=48, temperature=3.0, top_k=0, top_p=1.0, seed=seed))
        if result.finish_reason == "stop":
            assert result.token_ids[-1] in eos
            assert not eos & set(result.token_ids[:-1])
            break
    else:
        pytest.fail("no sampled run ended on eos")


def test_ignore_eos_runs_to_max_tokens(tiny_engine: Engine) -> None:
    eos = set(tiny_engine.spec.generation.eos_token_ids)
    for seed in range(200):
        request = GenerateRequest(messages=MESSAGES, max_tokens=48, temperature=3.0,
                                  top_k=0, top_p=1.0, seed=seed)
        if tiny_engine.generate(request).finish_reason == "stop":
            request.ignore_eos = True
            result = tiny_engine.generate(request)
            assert result.finish_reason == "length" and len(result.token_ids) == 48
            assert eos & set(result.token_ids)
            return
    pytest.fail("no sampled run ended on eos")


def test_prompt_too_long() -> None:
    engine = Engine(parity_config(TINY, max_context_tokens=32, infer_requests=1))
    long = [{"role": "user", "content": "word " * 40}]
    with pytest.raises(PromptTooLong):
        engine.generate(GenerateRequest(messages=long, max_tokens=4))
    # A prompt that fits stops at the context limit with finish_reason length.
    result = engine.generate(GenerateRequest(messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=100, temperature=0.0))
    assert result.finish_reason == "length"
    assert result.usage.prompt_tokens + result.usage.completion_tokens == 32


def test_streaming_text_concatenates_to_the_result(tiny_engine: Engine) -> None:
    for case in TEXT_CASES:
        pieces: list[str] = []
        ids: list[int] = []

        def collect(text: str, new: list[int], pieces: list[str] = pieces,
                    ids: list[int] = ids) -> None:
            pieces.append(text)
            ids.extend(new)

        result = tiny_engine.generate(greedy(case), on_token=collect)
        assert "".join(pieces) == result.text
        assert ids == result.token_ids
        # No piece ends inside a multi-byte character (no replacement char at the end),
        # unless the model itself produced invalid bytes that stay invalid.
        for piece in pieces[:-1]:
            assert not piece.endswith("\ufffd") or "\ufffd" in result.text


def test_streaming_holds_back_a_possible_stop_string(tiny_engine: Engine) -> None:
    free = tiny_engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=24,
                                                temperature=0.0))
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    pieces: list[str] = []
    result = tiny_engine.generate(
        GenerateRequest(messages=MESSAGES, max_tokens=24, temperature=0.0, stop=[stop]),
        on_token=lambda t, i: pieces.append(t))
    assert "".join(pieces) == result.text
    assert all(stop not in p for p in pieces)


def test_timings_and_usage_are_filled(tiny_engine: Engine) -> None:
    result = tiny_engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=8,
                                                  temperature=0.0))
    t = result.timings
    assert 0 < t.prefill_s <= t.ttft_s <= t.total_s
    assert t.decode_s > 0
    assert result.to_dict()["usage"]["completion_tokens"] == 8


def test_cancellation_between_steps(tiny_engine: Engine) -> None:
    calls = {"n": 0}

    def stop_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    result = tiny_engine.generate(GenerateRequest(
        messages=MESSAGES, max_tokens=50, temperature=0.0), should_stop=stop_after_three)
    assert result.finish_reason == "cancelled"
    assert 0 < len(result.token_ids) < 50


@pytest.mark.parametrize(
    ("messages", "kw"),
    [
        ([], {}),
        ([{"role": "robot", "content": "hi"}], {}),
        ([{"role": "user", "content": 3}], {}),
        ([{"role": "user", "content": [{"type": "audio", "audio": b""}]}], {}),
        ([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}], {}),
        (MESSAGES, {"max_tokens": 0}),
        (MESSAGES, {"max_tokens": 2**31}),
        (MESSAGES, {"temperature": -1.0}),
        (MESSAGES, {"top_p": 0.0}),
        (MESSAGES, {"top_k": -2}),
        (MESSAGES, {"repetition_penalty": 0.0}),
    ],
)
def test_bad_requests_are_refused(tiny_engine: Engine, messages: Any, kw: Any) -> None:
    with pytest.raises(BadRequest):
        tiny_engine.generate(GenerateRequest(messages=messages, **kw))
    # ...and the engine keeps serving.
    assert tiny_engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=2)).token_ids


def test_missing_model_dir_is_model_invalid(tmp_path: Path) -> None:
    with pytest.raises(ModelInvalid):
        Engine(Config(model=ModelConfig(path=tmp_path / "nope")))
    with pytest.raises(ModelInvalid):
        Engine(Config(model=ModelConfig(path=tmp_path)))
    with pytest.raises(ModelInvalid):
        Engine(Config())


def test_infer_request_pool_serves_threads_concurrently() -> None:
    from concurrent.futures import ThreadPoolExecutor

    engine = Engine(parity_config(TINY, infer_requests=3))
    case = CASES[1]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: engine.generate(greedy(case)).token_ids, range(6)))
    assert all(r == case["token_ids"] for r in results)
    assert len(engine.pool.slots) == 3


def test_default_precision_is_left_to_the_runtime(tiny_dir: Path) -> None:
    engine = Engine(Config(model=ModelConfig(path=tiny_dir), engine=EngineConfig(
        infer_requests=1)))
    result = engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=4, temperature=0))
    assert len(result.token_ids) == 4


@pytest.mark.parametrize(("setting", "expected"), [("off", "0"), (64, "64")])
def test_dynamic_quantization_setting_reaches_the_runtime(tiny_dir: Path, setting: Any,
                                                          expected: str) -> None:
    engine = Engine(Config(model=ModelConfig(path=tiny_dir, dynamic_quantization=setting),
                           engine=EngineConfig(infer_requests=1)))
    assert engine.models.runtime_properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == expected
    assert len(engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=3)).token_ids) == 3


def test_logprobs_leave_the_tokens_alone_and_describe_each(tiny_engine: Engine) -> None:
    request = GenerateRequest(messages=MESSAGES, max_tokens=12, temperature=0.0)
    plain = tiny_engine.generate(request)
    streamed: list[dict[str, Any]] = []
    asked = tiny_engine.generate(
        GenerateRequest(messages=MESSAGES, max_tokens=12, temperature=0.0, logprobs=3),
        on_token=lambda text, ids, logprobs=None: streamed.extend(logprobs or []))
    assert asked.token_ids == plain.token_ids and plain.logprobs is None
    assert asked.logprobs is not None and len(asked.logprobs) == len(asked.token_ids)
    assert [e["token_id"] for e in asked.logprobs] == asked.token_ids
    assert streamed == asked.logprobs
    for entry in asked.logprobs:
        tops = [t["logprob"] for t in entry["top"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry["logprob"] <= 0 and tops[0] >= entry["logprob"]
        # Greedy: the chosen token is among the likeliest.
        assert entry["token_id"] in [t["token_id"] for t in entry["top"]]
    with pytest.raises(BadRequest, match="logprobs"):
        parse_generate({"messages": MESSAGES, "logprobs": 21})
