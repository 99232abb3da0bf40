"""Plain data in and out of the engine: the fields of the protocol's `generate`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Defined where they are used first, named here for the engine's callers.
from qvld.engine.decoding.generation import FinishReason, TokenCallback
from qvld.engine.inputs.request import GenerateRequest
from qvld.engine.inputs.tools import ToolCall

__all__ = ["FinishReason", "GenerateRequest", "GenerateResult", "ServedModel", "SessionInfo",
           "Timings", "TokenCallback", "Usage", "cancelled_result"]


@dataclass(frozen=True)
class ServedModel:
    """What the fronts may say about the model an engine serves (``Engine.served``):
    nothing else of the engine's insides reaches them."""

    name: str
    path: Path
    chat_template: str
    eos_token_ids: tuple[int, ...]
    runtime: str  # model.backend's, and its version
    runtime_version: str
    runtime_properties: dict[str, str]  # what the runtime actually runs with
    prompt_runtime: str  # the runtime that prefills prompts
    continuous_batching: bool
    load_s: float


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    image_tokens: int = 0
    cached_tokens: int = 0
    forced_tokens: int = 0  # completion tokens a response format forced (not sampled)


@dataclass
class Timings:
    queue_s: float = 0.0
    image_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0


@dataclass
class SessionInfo:
    """What became of the request's session: ``turns`` after this request, and whether
    the context the client expected was lost (expired, evicted, closed by an admin, or
    no longer rebuildable) so that this turn started a fresh conversation."""

    id: str
    turns: int
    reset: bool = False


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    # For metrics, not part of the protocol's result:
    token_gaps: list[float] = field(default_factory=list, repr=False)
    image_cache_hits: int = 0
    image_cache_misses: int = 0
    session: SessionInfo | None = None
    # A response format's type, its compile time (None: cached, or none), and each
    # step's mask time.
    response_format: str | None = None
    grammar_compile_s: float | None = None
    mask_s: list[float] = field(default_factory=list, repr=False)
    # One entry per generated token when asked (see decoding.generation.Decoding).
    logprobs: list[dict[str, Any]] | None = None
    # The answer's calls of the request's tools (``text`` is what came before them).
    tool_calls: list[ToolCall] | None = None
    # A response format ended the answer early, the budget running out (finish "length").
    closed: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = {"text": self.text, "token_ids": self.token_ids,
               "finish_reason": self.finish_reason, "usage": asdict(self.usage),
               "timings": asdict(self.timings)}
        if self.session is not None:
            out["session"] = asdict(self.session)
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.tool_calls is not None:
            out["tool_calls"] = [call.to_dict() for call in self.tool_calls]
        return out


def cancelled_result() -> GenerateResult:
    """The reply to a generation that ended before it produced anything."""
    return GenerateResult(text="", token_ids=[], finish_reason="cancelled", usage=Usage(),
                          timings=Timings())
