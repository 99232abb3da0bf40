"""What a generation answers: its result from what ran (the text, usage and timings),
a cancelled one's, and an answer that calls the request's tools split into its text and
its calls."""

from __future__ import annotations

import time

from qvld.engine.inputs.tools import HeldText, ToolSet, split_calls
from qvld.engine.preparer import PreparedRequest
from qvld.engine.runners import Generation, Ran
from qvld.engine.types import GenerateResult, Timings, Usage


def finished(prepared: PreparedRequest, gen: Generation, ran: Ran) -> GenerateResult:
    """The result of a generation that ran (to its end, a stop, or its budget)."""
    prompt, outcome, t_vision, t_generate = ran
    admit_wait = 0.0
    if gen.seq is not None and gen.seq.admitted is not None:
        admit_wait = max(0.0, gen.seq.admitted - gen.seq.submitted)
    queue_s = gen.slot_wait_s + admit_wait
    waited = prepared.prepare_s + gen.slot_wait_s  # before the slot took it
    constraint = prepared.constraint
    return GenerateResult(
        text=outcome.text,
        token_ids=outcome.token_ids,
        finish_reason=outcome.finish_reason,
        usage=Usage(
            prompt_tokens=len(prompt.ids),
            completion_tokens=len(outcome.token_ids),
            image_tokens=int(prompt.visual_mask.sum()),
            cached_tokens=outcome.cached_tokens,
            forced_tokens=outcome.forced_tokens,
        ),
        timings=Timings(
            image_s=prepared.prepare_s + t_generate - t_vision,
            queue_s=round(queue_s, 6),
            prefill_s=outcome.prefill_s,
            ttft_s=waited + (t_generate - gen.t_start) + outcome.ttft_s,
            decode_s=outcome.decode_s,
            total_s=waited + time.perf_counter() - gen.t_start,
        ),
        token_gaps=outcome.token_gaps,
        image_cache_hits=prompt.image_cache_hits,
        image_cache_misses=prompt.image_cache_misses,
        response_format=None if constraint is None else constraint.format.type,
        grammar_compile_s=None if constraint is None else constraint.compile_s,
        mask_s=[] if constraint is None else constraint.mask_s,
        logprobs=outcome.logprobs,
        closed=outcome.closed,
    )


def cancelled(prepared: PreparedRequest, gen: Generation) -> GenerateResult:
    """The result of a generation cancelled before it ran: its prompt, no tokens."""
    waited = time.monotonic() - gen.enqueued
    return GenerateResult(
        text="", token_ids=[], finish_reason="cancelled",
        usage=Usage(prompt_tokens=len(prepared.ids),
                    image_tokens=sum(i.tokens for i in prepared.images)),
        timings=Timings(image_s=prepared.prepare_s,
                        total_s=prepared.prepare_s + waited))


def split_tool_calls(result: GenerateResult, tools: ToolSet, held: HeldText | None) -> None:
    """Calls of the tools: finish "tool_calls" and the text before them as the text
    (a call cut off by the budget is no call: the text stays whole, finish "length";
    one the response format closed as the budget ran out is, finish "length");
    otherwise the text a stream held back goes out now."""
    # A call the constraint closed early (the budget ran out) is still a call.
    ended = result.finish_reason == "stop" or result.closed
    split = split_calls(result.text, tools) if ended else None
    if split is not None:
        result.text, result.tool_calls = split
        if not result.closed:  # closed early it says so: "length"
            result.finish_reason = "tool_calls"
    if held is not None:
        held.release(result.text)
