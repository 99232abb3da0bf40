"""Reference tier: rebuild the test models, run transformers live, compare exactly.

Needs the `convert` extra (torch, transformers, optimum-intel): `make test-reference`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qvld.engine import Engine, GenerateRequest
from qvld.engine.inputs.image import prepare
from qvld.engine.inputs.tools import parse_tools
from qvld.engine.inputs.vision import (
    position_corners,
    rotary_embedding,
    to_merge_order,
    torch_linspace,
)
from tests.conftest import TINY, load_reference, parity_config, with_image_bytes

pytestmark = [pytest.mark.reference, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


PRESETS = ("tiny", "tiny-alt")


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    models = {}
    for preset in PRESETS:
        out = tmp_path_factory.mktemp(preset) / "model"
        subprocess.run(
            [sys.executable, str(ROOT / "tools" / "make_test_model.py"), preset, str(out),
             "--reference", "--onnx", "--keep-hf"],
            check=True, capture_output=True,
        )
        models[preset] = out
    return models


@pytest.mark.parametrize("backend", ["openvino", "onnxruntime"])
@pytest.mark.parametrize("preset", PRESETS)
def test_rebuilt_model_matches_transformers_exactly(rebuilt: dict[str, Path],
                                                    preset: str, backend: str) -> None:
    path = rebuilt[preset]
    reference = load_reference(path)
    engine = Engine(parity_config(path, backend=backend, prefill_chunk=64))
    assert len(reference["cases"]) >= 6 + 12
    for case in reference["cases"]:
        # A near-tie would make exact parity a coin toss: the cases must be decisive.
        assert case["min_margin"] > 1e-3, case["name"]
        request = GenerateRequest(messages=with_image_bytes(case["messages"], path),
                                  max_tokens=case["max_new_tokens"], temperature=0.0)
        ids, *_ = engine.tokenize(request)
        assert ids == case["input_ids"], case["name"]
        assert engine.generate(request).token_ids == case["token_ids"], case["name"]
    # Tools, template variables and videos through Qwen3-VL's own template and processor.
    assert reference["tool_cases"] and reference["video_cases"]
    for case in [*reference["tool_cases"], *reference["video_cases"]]:
        assert case["min_margin"] > 1e-3, case["name"]
        request = GenerateRequest(messages=with_image_bytes(case["messages"], path),
                                  max_tokens=case["max_new_tokens"], temperature=0.0,
                                  tools=parse_tools(case.get("tools")),
                                  template_kwargs=case.get("template_kwargs"))
        ids, *_ = engine.tokenize(request)
        assert ids == case["input_ids"], case["name"]
        assert engine.generate(request).token_ids == case["token_ids"], case["name"]
    # Multi-turn sessions: each follow-up equals transformers on the exact sequence.
    assert reference["sessions"]
    for session in reference["sessions"]:
        for turn in session["turns"]:
            assert turn["min_margin"] > 1e-3, session["name"]
            result = engine.generate(GenerateRequest(
                messages=with_image_bytes(turn["messages"], path), temperature=0.0,
                max_tokens=turn["max_new_tokens"], session=session["name"]))
            assert result.usage.prompt_tokens == len(turn["input_ids"]), session["name"]
            assert result.token_ids == turn["token_ids"], session["name"]


def test_a_converted_model_samples_clips_with_its_own_video_settings(
        rebuilt: dict[str, Path], tmp_path: Path) -> None:
    """#48: `qvlctl model convert` left video_preprocessor_config.json behind, so clips
    were sampled and sized with transformers' class defaults. tiny-alt's checkpoint has
    its own settings: converted, it gives transformers' prompt and greedy ids on every
    clip; without that file the prompts differ (the case can tell)."""
    import shutil

    path = rebuilt["tiny-alt"]
    reference = load_reference(path)
    converted = tmp_path / "converted"
    out = subprocess.run([sys.executable, "-m", "qvlctl.cli", "model", "convert",
                          str(path / "hf"), str(converted), "--weights", "fp32"],
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr
    assert (converted / "video_preprocessor_config.json").is_file()
    shutil.copytree(path / "images", converted / "images")
    engine = Engine(parity_config(converted, prefill_chunk=64))
    assert reference["video_cases"]
    for case in reference["video_cases"]:
        request = GenerateRequest(messages=with_image_bytes(case["messages"], converted),
                                  max_tokens=case["max_new_tokens"], temperature=0.0,
                                  template_kwargs=case.get("template_kwargs"))
        ids, *_ = engine.tokenize(request)
        assert ids == case["input_ids"], case["name"]
        assert engine.generate(request).token_ids == case["token_ids"], case["name"]
    engine.close()
    (converted / "video_preprocessor_config.json").unlink()
    defaults = Engine(parity_config(converted, prefill_chunk=64))
    try:
        differ = [case["name"] for case in reference["video_cases"]
                  if defaults.tokenize(GenerateRequest(
                      messages=with_image_bytes(case["messages"], converted), max_tokens=1,
                      template_kwargs=case.get("template_kwargs")))[0] != case["input_ids"]]
        assert differ, "the class defaults give the same prompts: the case tells nothing"
    finally:
        defaults.close()


@pytest.mark.parametrize("preset", PRESETS)
def test_rebuilt_model_batched_with_others_matches_transformers(rebuilt: dict[str, Path],
                                                                preset: str) -> None:
    """Continuous batching: every case packed with others of different lengths, images
    and start times (six at once, prompts fed in chunks between their tokens)."""
    from concurrent.futures import ThreadPoolExecutor

    path = rebuilt[preset]
    cases = load_reference(path)["cases"]
    engine = Engine(parity_config(path, infer_requests=6, prefill_chunk=40,
                                  max_batch_tokens=80))
    assert engine.batch is not None

    def run(case: dict[str, Any]) -> list[int]:
        return engine.generate(GenerateRequest(
            messages=with_image_bytes(case["messages"], path),
            max_tokens=case["max_new_tokens"], temperature=0.0)).token_ids

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(run, cases))
    for case, ids in zip(cases, answers, strict=True):
        assert ids == case["token_ids"], case["name"]
    assert engine.batch.peak_sequences >= 4


@pytest.mark.parametrize("preset", PRESETS)
def test_rebuilt_pixels_equal_the_processor(rebuilt: dict[str, Path], preset: str) -> None:
    import numpy as np

    path = rebuilt[preset]
    reference = load_reference(path)
    pixels = np.load(path / "reference_pixels.npz")
    engine = Engine(parity_config(path, infer_requests=1))
    budget = engine.image_budget(GenerateRequest(messages=[]))
    for name, file in reference["images"].items():
        image = prepare((path / "images" / file).read_bytes(), engine.spec.vision, budget,
                        engine.config.engine.max_decode_pixels)
        assert [1, image.grid_h, image.grid_w] == pixels[f"{name}/grid_thw"].tolist(), name
        assert np.abs(image.patches - pixels[f"{name}/pixel_values"]).max() <= 1e-5, name


def test_vision_position_helpers_equal_transformers() -> None:
    import numpy as np
    import torch
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    for side in (12, 16, 48):
        for steps in range(1, 200):
            expected = torch.linspace(0, side - 1, steps).numpy()
            assert np.array_equal(torch_linspace(0, side - 1, steps), expected)
    config = Qwen3VLConfig.from_pretrained(TINY).vision_config
    model = Qwen3VLVisionModel._from_config(config).eval()
    side = int(config.num_position_embeddings ** 0.5)
    table = model.pos_embed.weight.detach().numpy()
    for gh, gw in [(4, 6), (8, 8), (48, 4), (6, 44)]:
        grid = torch.tensor([[1, gh, gw]])
        rotary = model.rot_pos_emb(grid).numpy()
        head_dim = config.hidden_size // config.num_heads
        np.testing.assert_array_equal(rotary_embedding(gh, gw, 2, head_dim), rotary)
        idx, weights = position_corners(gh, gw, side)
        with torch.no_grad():
            expected = model.fast_pos_embed_interpolate(grid).numpy()
        ours = (table[idx] * weights[:, :, None]).sum(0)
        np.testing.assert_allclose(to_merge_order(ours, gh, gw, 2), expected, atol=1e-6)


def test_presets_differ_in_every_dimension(rebuilt: dict[str, Path]) -> None:
    import json

    a, b = (json.loads((rebuilt[p] / "config.json").read_text()) for p in PRESETS)
    for section, keys in {
        "text_config": ("hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "vocab_size", "rope_parameters"),
        "vision_config": ("hidden_size", "depth", "num_heads", "patch_size",
                          "num_position_embeddings", "deepstack_visual_indexes"),
    }.items():
        for key in keys:
            assert a[section][key] != b[section][key], (section, key)
    assert a["image_token_id"] != b["image_token_id"]


def test_committed_fixture_is_what_the_tool_builds(rebuilt: dict[str, Path]) -> None:
    reference: dict[str, Any] = load_reference(rebuilt["tiny"])
    committed = load_reference(TINY)
    assert [c["input_ids"] for c in reference["cases"]] == [
        c["input_ids"] for c in committed["cases"]]
    assert [c["token_ids"] for c in reference["cases"]] == [
        c["token_ids"] for c in committed["cases"]]
    for kind in ("tool_cases", "video_cases"):
        assert [(c["input_ids"], c["token_ids"]) for c in reference[kind]] == [
            (c["input_ids"], c["token_ids"]) for c in committed[kind]], kind
    assert (rebuilt["tiny"] / "chat_template.jinja").read_text() == \
        (TINY / "chat_template.jinja").read_text()
    names = ["openvino_language_model.bin", "openvino_vision_embeddings_merger_model.bin",
             "onnx_language_model.onnx", "onnx_vision_embeddings_merger_model.onnx",
             "tokenizer.json", *(f"images/{f}" for f in committed["images"].values()),
             *(f"images/{f}" for f in committed["videos"].values())]
    for name in names:
        assert (rebuilt["tiny"] / name).read_bytes() == (TINY / name).read_bytes(), name
