from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "models" / "tiny"


def parity_config(path: Path, **engine: Any) -> Config:
    """f32 compute and f32 KV cache: the setting whose ids must equal transformers'."""
    return Config(
        model=ModelConfig(path=path, precision="f32", kv_cache_precision="f32"),
        engine=EngineConfig(**{"infer_requests": 2, **engine}),
    )


def load_reference(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "reference.json").read_text(encoding="utf-8")))


def with_image_bytes(messages: list[dict[str, Any]], model_dir: Path) -> list[dict[str, Any]]:
    """Reference messages name image files; the engine takes their bytes."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": (model_dir / "images" / part["image"]).read_bytes()}
                if part["type"] == "image" else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def tiny_engine() -> Iterator[Engine]:
    yield Engine(parity_config(TINY, prefill_chunk=64))


@pytest.fixture(scope="session")
def tiny_reference() -> dict[str, Any]:
    return load_reference(TINY)
