"""Plain data in and out of the engine: the fields of the protocol's `generate`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from qvld.engine.constraints import ResponseFormat
    from qvld.engine.tools import ToolCall, ToolSet

# "tool_calls": the answer is calls of the request's tools (it stopped after them).
FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]


@dataclass
class GenerateRequest:
    """One generation. ``None`` means: take the model's generation_config / engine default."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    max_image_tokens: int | None = None
    session: str | None = None  # continue (or start) this conversation
    response_format: ResponseFormat | None = None  # what the answer must match
    # Each generated token's log-probability and this many alternatives (0..20); None: off.
    logprobs: int | None = None
    min_p: float | None = None
    tools: ToolSet | None = None  # the tools it may call, and how
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs
    n: int = 1  # answers to the prompt (choices), each sampled on its own


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
    # One entry per generated token when asked (see generate.Decoding).
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


# on_token(text_delta, new_token_ids): called as text becomes final (never mid-character,
# never a possible stop-string prefix). A request that asks for logprobs calls it with a
# third argument, the entries of those ids (``logprobs=``).
TokenCallback = Callable[..., None]


def cancelled_result() -> GenerateResult:
    """The reply to a generation that ended before it produced anything."""
    return GenerateResult(text="", token_ids=[], finish_reason="cancelled", usage=Usage(),
                          timings=Timings())
