"""Typed, frozen configuration.

Every key has a default, so ``Config()`` plus a model path is a working configuration.
Unknown keys are errors (``extra='forbid'``); all errors of one load are collected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    path: Path | None = None
    device: Literal["CPU"] = "CPU"
    backend: Literal["openvino"] = "openvino"
    precision: Literal["auto", "f32", "bf16"] = "auto"
    kv_cache_precision: Literal["auto", "f32", "f16", "u8"] = "auto"
    cache_dir: Path | None = None
    warmup: bool = True


class EngineConfig(_Section):
    threads: int | Literal["auto"] = "auto"
    streams: int = Field(1, ge=1)
    infer_requests: int = Field(4, ge=1, le=64)
    max_image_tokens: int = Field(1024, ge=1)
    default_image_tokens: int = Field(256, ge=1)
    max_images: int = Field(8, ge=0)
    # Decompression-bomb guard: images whose header declares more pixels are refused.
    max_decode_pixels: int = Field(64_000_000, ge=1)
    max_context_tokens: int = Field(8192, ge=16)
    max_new_tokens: int = Field(512, ge=1)
    default_max_tokens: int = Field(128, ge=1)
    prefill_chunk: int = Field(512, ge=1)
    image_cache_mb: int = Field(256, ge=0)
    kv_cache_mb: int = Field(2048, ge=0)
    sessions_max: int = Field(64, ge=0)
    session_ttl_s: float = Field(900, gt=0)

    @model_validator(mode="after")
    def _defaults_within_limits(self) -> EngineConfig:
        if isinstance(self.threads, int) and self.threads < 1:
            raise ValueError("threads must be 'auto' or >= 1")
        if self.default_image_tokens > self.max_image_tokens:
            raise ValueError("default_image_tokens must not exceed max_image_tokens")
        if self.default_max_tokens > self.max_new_tokens:
            raise ValueError("default_max_tokens must not exceed max_new_tokens")
        return self


class Config(_Section):
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
