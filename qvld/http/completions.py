"""OpenAI's legacy text completions (``POST /v1/completions``, which some clients still
post to) <-> protocol v1 ``generate`` with a raw ``prompt``: no chat template, text only.
Translation only, no I/O; its answers share chat completions' usage, choices and SSE
framing (``openai``)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from qvld.config import did_you_mean
from qvld.engine.inputs.request import MAX_CHOICES
from qvld.errors import QvlError
from qvld.http.dialect import bad, sse
from qvld.http.openai import MAX_USER_CHARS, ChatRequest, error_body, stream_options
from qvld.http.openai_replies import choices, usage

FIELDS = frozenset({
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
    "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user", "echo",
    "suffix", "best_of", "logprobs",
    # extensions, as on chat completions
    "top_k", "min_p", "repetition_penalty", "ignore_eos",
})
PASSED = ("temperature", "top_p", "stop", "seed", "presence_penalty",
                     "frequency_penalty", "logit_bias", "top_k", "min_p",
                     "repetition_penalty", "ignore_eos")
DEFAULT_TOKENS = 16  # OpenAI's (and vLLM's) for this API


def parse_completion(body: Any) -> ChatRequest:
    """A ``POST /v1/completions`` body -> protocol v1 params with a raw ``prompt`` (no
    chat template, text only). ``max_tokens`` defaults to 16, as OpenAI's API does."""
    if not isinstance(body, dict):
        raise bad("", "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            hint = did_you_mean(str(name), FIELDS)
            raise bad(str(name), f"unknown field {name!r}{hint}")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt", "prompt must be a string (one prompt per request)")
    for name, off in (("echo", (None, False)), ("suffix", (None, "")), ("best_of", (None, 1)),
                      ("logprobs", (None,))):
        if body.get(name) not in off:
            raise bad(name, f"{name} is not supported by this server")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    include_usage = stream_options(body.get("stream_options"), stream)
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)
                          or not 1 <= n <= MAX_CHOICES):
        raise bad("n", f"n must be an integer within 1..{MAX_CHOICES}")
    params: dict[str, Any] = {"prompt": prompt, "stream": stream,
                              "max_tokens": body.get("max_tokens",
                                                     DEFAULT_TOKENS)}
    if params["max_tokens"] is None:
        params["max_tokens"] = DEFAULT_TOKENS
    for name in PASSED:
        if body.get(name) is not None:
            params[name] = body[name]
    if n is not None and n > 1:
        params["n"] = n
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise bad("user", f"user must be a string of at most {MAX_USER_CHARS} characters")
    return ChatRequest(params, stream, include_usage, body.get("model"), user)


class CompletionReplies:
    """How text completions answer: a ``text_completion``, or its chunks and
    ``[DONE]``."""

    media_type = "text/event-stream"

    def __init__(self, asked: ChatRequest, model: str) -> None:
        self.ident = ("cmpl-" + secrets.token_hex(12), int(time.time()), model)
        self.include_usage = asked.include_usage

    def _body(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        cid, created, model = self.ident
        return {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": choices}

    def whole(self, result: dict[str, Any]) -> bytes:
        return json.dumps({**self._body([
            {"index": c["index"], "text": c["text"], "logprobs": None,
             "finish_reason": _completion_reason(c)} for c in choices(result)]),
            "usage": usage(result)}, ensure_ascii=False).encode()

    def first(self) -> bytes:
        return b""

    def tokens(self, event: dict[str, Any]) -> bytes:
        if not event["text"]:
            return b""
        return sse(self._body([{"index": event.get("index", 0), "text": event["text"],
                                "logprobs": None, "finish_reason": None}]))

    def last(self, result: dict[str, Any]) -> bytes:
        tail: list[dict[str, Any] | str] = [self._body([{
            "index": c["index"], "text": "", "logprobs": None,
            "finish_reason": _completion_reason(c)}]) for c in choices(result)]
        if self.include_usage:
            tail.append({**self._body([]), "usage": usage(result)})
        return sse(*tail, "[DONE]")

    def failed(self, exc: QvlError) -> bytes:
        return sse(error_body(exc)[1])


def _completion_reason(choice: dict[str, Any]) -> str:
    return "length" if choice["finish_reason"] == "length" else "stop"
