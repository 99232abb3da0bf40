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
from tests.conftest import TINY, load_reference, parity_config

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
             "--reference"],
            check=True, capture_output=True,
        )
        models[preset] = out
    return models


@pytest.mark.parametrize("preset", PRESETS)
def test_rebuilt_model_matches_transformers_exactly(rebuilt: dict[str, Path],
                                                    preset: str) -> None:
    path = rebuilt[preset]
    reference = load_reference(path)
    engine = Engine(parity_config(path, prefill_chunk=64))
    assert len(reference["cases"]) >= 6
    for case in reference["cases"]:
        # A near-tie would make exact parity a coin toss: the cases must be decisive.
        assert case["min_margin"] > 1e-3, case["name"]
        prompt, _ = engine.build_prompt(GenerateRequest(messages=case["messages"]))
        assert prompt.ids == case["input_ids"], case["name"]
        result = engine.generate(GenerateRequest(
            messages=case["messages"], max_tokens=case["max_new_tokens"], temperature=0.0))
        assert result.token_ids == case["token_ids"], case["name"]


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
    for name in ("openvino_language_model.bin", "tokenizer.json"):
        assert (rebuilt["tiny"] / name).read_bytes() == (TINY / name).read_bytes(), name
