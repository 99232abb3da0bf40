"""What qvlctl accepts from the daemon: protocol v1 replies, checked before use.

A reply that breaks the protocol (a frame that is not msgpack or not a map, a reply
missing fields, a result of the wrong shape, an error whose code is not a string)
raises :class:`MalformedReply`. It is the daemon's fault (or something else listens on
the socket), so it must never read as the user's request being refused (exit 4) nor
as a lost connection (exit 3), and never end in a traceback: qvlctl reports it in one
line and exits 1.

Only what qvlctl reads is checked; extra fields pass, so a newer daemon that adds
fields still works with this client.
"""

from __future__ import annotations

from typing import Any, TypeVar

from qvld import protocol
from qvld.errors import ERRORS_BY_CODE, InternalError, QvlError

T = TypeVar("T")
_MISSING = object()
USAGE_NUMBERS = ("prompt_tokens", "completion_tokens", "image_tokens", "cached_tokens",
                 "forced_tokens")
TIMING_NUMBERS = ("queue_s", "image_s", "prefill_s", "ttft_s", "decode_s", "total_s")


class MalformedReply(Exception):
    """The daemon sent something protocol v1 does not allow."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


# -- frames ---------------------------------------------------------------------------


REPLY_MAX_OBJECTS = 1 << 24


def decode(payload: bytes, max_frame_bytes: int) -> dict[str, Any]:
    """One frame's payload -> a reply map."""
    try:
        # A reply may hold more values than a request may (token ids, sessions).
        message = protocol.unpack(payload, max_frame_bytes, max_objects=REPLY_MAX_OBJECTS)
    except QvlError as exc:  # bad_request would blame the user's request: it is the reply
        raise MalformedReply(exc.message) from None
    if not isinstance(message, dict):
        raise MalformedReply(f"a frame holds {_kind(message)}, not a map")
    return message


# -- generic shapes -------------------------------------------------------------------


def as_map(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise MalformedReply(f"{what} is {_kind(value)}, expected a map")
    return value


def as_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise MalformedReply(f"{what} is {_kind(value)}, expected a list")
    return value


def field(mapping: dict[str, Any], key: str, kind: type[T], what: str,
          default: Any = _MISSING) -> T:
    """``mapping[key]`` of type ``kind`` (``default`` when absent, if one is given)."""
    value = mapping.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise MalformedReply(f"{what} has no {key!r}")
        return default  # type: ignore[no-any-return]
    # bool is an int to Python, never to the protocol.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise MalformedReply(f"{what}.{key} is {_kind(value)}, expected {kind.__name__}")
    return value


def _numbers(mapping: dict[str, Any], keys: tuple[str, ...], what: str) -> None:
    for key in keys:
        value = mapping.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MalformedReply(f"{what}.{key} is {_kind(value)}, expected a number")


def _ints(value: Any, what: str) -> list[int]:
    items = as_list(value, what)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise MalformedReply(f"{what} holds something other than integers")
    return items


# -- replies --------------------------------------------------------------------------


def reply_id(reply: dict[str, Any]) -> int | None:
    """The request a reply answers (nil: the daemon could not read the request)."""
    if "id" not in reply:
        raise MalformedReply("a reply has no 'id'")
    rid = reply["id"]
    if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
        raise MalformedReply(f"a reply's id is {_kind(rid)}, expected an integer or nil")
    return rid


def token(reply: dict[str, Any]) -> tuple[str, list[int]] | None:
    """A streaming event's text and ids (None for event kinds this client does not know)."""
    if field(reply, "event", str, "an event") != "token":
        return None
    return field(reply, "text", str, "a token event"), _ints(reply.get("token_ids", []),
                                                             "a token event's token_ids")


def error(reply: dict[str, Any]) -> QvlError:
    """The daemon's error as the class it raised (unknown codes: internal)."""
    body = as_map(reply.get("error"), "a failed reply's error")
    code = field(body, "code", str, "the error")
    message = field(body, "message", str, "the error", default="")
    return ERRORS_BY_CODE.get(code, InternalError)(message or code)


def result(reply: dict[str, Any]) -> Any:
    """A final reply's result, or its error raised."""
    if not field(reply, "ok", bool, "a reply"):
        raise error(reply)
    if "result" not in reply:
        raise MalformedReply("a successful reply has no 'result'")
    return reply["result"]


# -- results of the ops qvlctl renders ------------------------------------------------


def health(value: Any) -> dict[str, Any]:
    doc = as_map(value, "the health result")
    field(doc, "state", str, "the health result")
    field(doc, "ready", bool, "the health result")
    return doc


def drain(value: Any) -> dict[str, Any]:
    doc = as_map(value, "the drain result")
    field(doc, "state", str, "the drain result")
    field(doc, "in_flight", int, "the drain result")
    return doc


def sessions(value: Any) -> list[dict[str, Any]]:
    rows = as_list(field(as_map(value, "the sessions result"), "sessions", list,
                         "the sessions result"), "sessions")
    return [as_map(row, "a session") for row in rows]


def closed(value: Any) -> bool:
    return field(as_map(value, "the sessions result"), "closed", bool, "the sessions result")


def metrics_text(value: Any) -> str:
    return field(as_map(value, "the metrics result"), "text", str, "the metrics result")


def reload(value: Any) -> dict[str, Any]:
    doc = as_map(value, "the reload result")
    field(doc, "reloaded", bool, "the reload result")
    if not all(isinstance(k, str) for k in field(doc, "restart_required", list,
                                                 "the reload result", default=[])):
        raise MalformedReply("the reload result's restart_required holds non-strings")
    return doc


def preflight(value: Any) -> dict[str, Any]:
    doc = as_map(value, "the preflight result")
    field(doc, "ok", bool, "the preflight result")
    for item in as_list(field(doc, "checks", list, "the preflight result"), "checks"):
        check = as_map(item, "a check")
        for key in ("id", "status", "found"):
            field(check, key, str, "a check")
        field(check, "remedy", str, "a check", default="")
    for item in as_list(field(doc, "tuning", list, "the preflight result"), "tuning"):
        action = as_map(item, "a tuning action")
        for key in ("action", "result", "detail"):
            field(action, key, str, "a tuning action")
    return doc


def cut_short(result: dict[str, Any]) -> bool:
    """Whether the daemon stopped this answer before it was complete.

    qvlctl never sends ``cancel`` (Ctrl-C closes the connection and exits 130), so a
    ``cancelled`` finish it receives was the daemon's doing: a drain at shutdown or
    reload. The text is then partial and must not pass for an answer.
    """
    return bool(result.get("finish_reason") == "cancelled")


def generated(value: Any) -> dict[str, Any]:
    """A ``generate`` result: text, token_ids, finish_reason; usage and timings numbers."""
    doc = as_map(value, "the generate result")
    field(doc, "text", str, "the generate result")
    field(doc, "finish_reason", str, "the generate result")
    _ints(field(doc, "token_ids", list, "the generate result"), "the result's token_ids")
    _numbers(field(doc, "usage", dict, "the generate result", default={}),
             USAGE_NUMBERS, "usage")
    _numbers(field(doc, "timings", dict, "the generate result", default={}),
             TIMING_NUMBERS, "timings")
    return doc
