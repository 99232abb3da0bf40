"""What an API dialect's translation module hands the HTTP server to answer in its
shape (``openai.ChatReplies``, ``anthropic.MessageReplies``): translation only, no I/O.
The server runs every dialect's generation the same way (``HttpServer._generate``)."""

from __future__ import annotations

import json
from typing import Any, Protocol

from qvld.errors import QvlError


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
