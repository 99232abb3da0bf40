"""How OpenAI's chat completions answer (``ChatReplies``): a ``chat.completion``, or a
stream of ``chat.completion.chunk`` events; the usage, choices, messages and logprobs
the text completions (``completions``) answer with too. Translation only, no I/O."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from qvld.errors import QvlError
from qvld.http.dialect import sse
from qvld.http.openai import ChatRequest, error_body


def logprobs_content(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Protocol v1's logprobs entries -> OpenAI's ``logprobs.content``."""
    def one(entry: dict[str, Any]) -> dict[str, Any]:
        return {"token": entry["token"], "logprob": entry["logprob"],
                "bytes": list(entry["token"].encode())}

    return [{**one(e), "top_logprobs": [one(t) for t in e["top"]]} for e in entries]


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def usage(result: dict[str, Any]) -> dict[str, Any]:
    """protocol v1's usage, in OpenAI's names (image tokens count as prompt tokens;
    the tokens a response format forced, fed without sampling, under
    ``completion_tokens_details``)."""
    u = result["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"],
                                      "image_tokens": u["image_tokens"]},
            "completion_tokens_details": {"reasoning_tokens": 0,
                                          "forced_tokens": u.get("forced_tokens", 0)}}


def _extras(result: dict[str, Any]) -> dict[str, Any]:
    """What protocol v1 says besides: timings (as llama-server adds them), the session."""
    out = {"timings": result["timings"]}
    if "session" in result:
        out["session"] = result["session"]
    return out


def message(result: dict[str, Any]) -> dict[str, Any]:
    """The answer as OpenAI's assistant message: content (null beside calls when there is
    no text), and the calls."""
    calls = result.get("tool_calls")
    if not calls:
        return {"role": "assistant", "content": result["text"]}
    return {"role": "assistant", "content": result["text"] or None, "tool_calls": calls}


def call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A stream's tool-call deltas, as OpenAI sends them: each call's index, id, type and
    name with empty arguments, then its arguments."""
    deltas: list[dict[str, Any]] = []
    for i, call in enumerate(calls):
        function = call["function"]
        deltas.append({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                       "function": {"name": function["name"],
                                                    "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": i, "function": {
            "arguments": function["arguments"]}}]})
    return deltas


def choices(result: dict[str, Any]) -> list[dict[str, Any]]:
    """protocol v1's choices (``n`` > 1), or the result as the one choice."""
    return list(result.get("choices") or [{"index": 0, **result}])


def completion(result: dict[str, Any], cid: str, created: int, model: str) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "message": message(c),
                         "finish_reason": c["finish_reason"],
                         "logprobs": None if c.get("logprobs") is None else
                         {"content": logprobs_content(c["logprobs"])}}
                        for c in choices(result)],
            "usage": usage(result), **_extras(result)}


def chunk(cid: str, created: int, model: str, delta: dict[str, Any],
          finish_reason: str | None = None,
          logprobs: list[dict[str, Any]] | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": None if logprobs is None else
                         {"content": logprobs_content(logprobs)}}]}


def usage_chunk(result: dict[str, Any], cid: str, created: int, model: str
                ) -> dict[str, Any]:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [], "usage": usage(result), **_extras(result)}


class ChatReplies:
    """How chat completions answer: a ``chat.completion``, or a stream of
    ``chat.completion.chunk`` events (one role chunk per choice first, the content as
    it comes, the calls and finish reasons, the usage when asked, ``[DONE]``)."""

    media_type = "text/event-stream"

    def __init__(self, chat: ChatRequest, model: str) -> None:
        self.ident = (completion_id(), int(time.time()), model)
        self.n = int(chat.params.get("n", 1))
        self.include_usage = chat.include_usage

    def whole(self, result: dict[str, Any]) -> bytes:
        return json.dumps(completion(result, *self.ident), ensure_ascii=False).encode()

    def first(self) -> bytes:
        return sse(*(chunk(*self.ident, {"role": "assistant", "content": ""}, index=i)
                     for i in range(self.n)))

    def tokens(self, event: dict[str, Any]) -> bytes:
        if not (event["text"] or event.get("logprobs")):  # ids alone (a held tool call)
            return b""
        return sse(chunk(*self.ident, {"content": event["text"]},
                         logprobs=event.get("logprobs"), index=event.get("index", 0)))

    def last(self, result: dict[str, Any]) -> bytes:
        tail: list[dict[str, Any] | str] = []
        for choice in choices(result):
            i = choice["index"]
            tail += [chunk(*self.ident, delta, index=i)
                     for delta in call_deltas(choice.get("tool_calls") or [])]
            tail.append(chunk(*self.ident, {}, choice["finish_reason"], index=i))
        if self.include_usage:
            tail.append(usage_chunk(result, *self.ident))
        return sse(*tail, "[DONE]")

    def failed(self, exc: QvlError) -> bytes:
        return sse(error_body(exc)[1])
