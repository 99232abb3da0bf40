"""What every API dialect's translation module shares: what it hands the HTTP front to
answer in its shape (``Replies``: ``openai_replies.ChatReplies``, ``anthropic.MessageReplies``;
translation only, no I/O), the HTTP status of each qvld error, and a bad request that
names its field. The front runs every dialect's generation the same way
(``streaming.Generations``)."""

from __future__ import annotations

import json
from typing import Any, Protocol

from qvld.errors import BadRequest, QvlError

# HTTP status by qvld error code (each dialect shapes the body its own way).
STATUS = {"bad_request": 400, "unsupported_version": 400, "image_invalid": 400,
          "image_too_large": 400, "video_invalid": 400, "prompt_too_long": 400,
          "frame_too_large": 413,
          "invalid_api_key": 401, "forbidden": 403, "not_found": 404,
          "method_not_allowed": 405, "session_lost": 409, "busy": 429, "unavailable": 503,
          "timeout": 504,
          "internal": 500}


class Replies(Protocol):
    """One request's answer: whole, or as a stream's frames (bytes, ready to write)."""

    media_type: str  # a stream's Content-Type

    def whole(self, result: dict[str, Any]) -> bytes:
        """The JSON body answering protocol v1's ``result``."""

    def first(self) -> bytes:
        """What a stream opens with (sent with the first token)."""

    def tokens(self, event: dict[str, Any]) -> bytes:
        """A token event's frames (b"" for none)."""

    def last(self, result: dict[str, Any]) -> bytes:
        """The stream's end."""

    def failed(self, exc: QvlError) -> bytes:
        """An error after the stream began."""


def raw_json(index: int) -> str:
    """A placeholder for the ``index``-th JSON text ``dumps_with_raw`` puts in verbatim
    (a tool call's arguments as the model wrote them: never parsed and re-serialised)."""
    return f"\x00raw{index}\x00"


def dumps_with_raw(body: dict[str, Any], raws: list[str]) -> str:
    """``body`` as JSON, each ``raw_json(i)`` placeholder replaced by ``raws[i]``."""
    text = json.dumps(body, ensure_ascii=False)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(raw_json(i)), raw, 1)
    return text


def bad(param: str, message: str) -> BadRequest:
    """A bad_request that names the offending field (OpenAI's ``param``)."""
    exc = BadRequest(message)
    exc.param = param or None  # type: ignore[attr-defined]
    return exc


def status_of(code: str) -> int:
    return STATUS.get(code, 500)


def error_status(exc: QvlError | None, code: str, message: str) -> tuple[int, str]:
    """(HTTP status, message) of a qvld error, or of an HTTP-level one (``code``):
    every dialect's error shape starts from these."""
    if exc is None:
        return status_of(code), message
    return getattr(exc, "http_status", None) or status_of(exc.code), exc.message


def sse(*events: dict[str, Any] | str, names: tuple[str | None, ...] = ()) -> bytes:
    """Server-Sent Events: each a ``data:`` line (JSON, or a literal like ``[DONE]``),
    after an ``event:`` line where ``names`` gives one (Anthropic's streams)."""
    out = []
    for i, event in enumerate(events):
        name = names[i] if i < len(names) else None
        data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
        out.append((f"event: {name}\n" if name else "") + f"data: {data}\n\n")
    return "".join(out).encode()
