"""Wire protocol v1: frames and message shapes. No I/O, no engine.

Frame layout (both directions)::

    +----------------------+------------------------------------------+
    | length: 4 bytes, BE  | payload: one msgpack map, `length` bytes |
    +----------------------+------------------------------------------+

The payload is packed with ``use_bin_type=True`` and read with ``raw=False`` and
``strict_map_key=True``; a length above ``max_frame_bytes`` is refused with
``frame_too_large`` (and the connection closed), since the rest of the stream can no
longer be trusted.

Requests::

    {id: int, op: str, params: map}          # params may be omitted: {}

Replies carry the request's id (nil when the request could not be read)::

    {id, ok: true, result: ...}
    {id, ok: false, error: {code, message, retryable}}
    {id, event: "token", text: str, token_ids: [int]}   # streaming generate only
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from qvld.errors import BadRequest, FrameTooLarge, QvlError

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 32 * 1024 * 1024

OPS = frozenset({
    "hello", "health", "status", "generate", "cancel", "sessions", "metrics",
    "preflight", "reload", "config",
})
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    params: dict[str, Any] = field(default_factory=dict)


def pack(message: dict[str, Any]) -> bytes:
    """One message -> one frame."""
    payload: bytes = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes, max_frame_bytes: int) -> int:
    (length,) = HEADER.unpack(header)
    if length > max_frame_bytes:
        raise FrameTooLarge(f"frame of {length} bytes exceeds the limit of {max_frame_bytes}")
    return int(length)


def unpack(payload: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """A frame's payload -> exactly one msgpack object, or ``bad_request``."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=True, use_list=True,
                                max_buffer_size=max(max_frame_bytes, len(payload)))
    try:
        unpacker.feed(payload)
        message = unpacker.unpack()
    except msgpack.OutOfData as exc:
        raise BadRequest("the frame ends inside a msgpack value") from exc
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the frame holds invalid UTF-8: {exc.reason}") from exc
    except (ValueError, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise BadRequest(f"the frame is not valid msgpack: {exc or type(exc).__name__}") from exc
    try:
        unpacker.unpack()
    except msgpack.OutOfData:
        return message
    except Exception:
        pass
    raise BadRequest("the frame holds more than one msgpack value")


class FrameBuffer:
    """Incremental reader for a byte stream: ``feed`` bytes, take complete payloads."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        frames = []
        while len(self._buf) >= HEADER.size:
            length = frame_length(bytes(self._buf[:HEADER.size]), self.max_frame_bytes)
            end = HEADER.size + length
            if len(self._buf) < end:
                break
            frames.append(bytes(self._buf[HEADER.size:end]))
            del self._buf[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held (0 between frames)."""
        return len(self._buf)


def request_id(message: Any) -> int | None:
    """The id to answer a message with: its own when readable, else nil."""
    if isinstance(message, dict):
        rid = message.get("id")
        if isinstance(rid, int) and not isinstance(rid, bool):
            return rid
    return None


def parse_request(message: Any) -> Request:
    """Validate a decoded frame as a request (``bad_request`` otherwise)."""
    if not isinstance(message, dict):
        raise BadRequest("a request must be a map {id, op, params}")
    rid = request_id(message)
    if rid is None:
        raise BadRequest("a request needs an integer id")
    unknown = set(message) - {"id", "op", "params"}
    if unknown:
        raise BadRequest(f"unknown request fields: {', '.join(sorted(map(str, unknown)))}")
    op = message.get("op")
    if not isinstance(op, str):
        raise BadRequest("a request needs an op (string)")
    if op not in OPS:
        raise BadRequest(f"unknown op {op!r}")
    params = message.get("params")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("params must be a map")
    return Request(id=rid, op=op, params=params)


def ok(rid: int | None, result: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, "result": result}


def error(rid: int | None, exc: QvlError) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": exc.to_wire()}


def token_event(rid: int, text: str, token_ids: list[int]) -> dict[str, Any]:
    return {"id": rid, "event": "token", "text": text, "token_ids": token_ids}
