"""Wire protocol v1: frames and message shapes. No I/O, no engine.

Frame layout (both directions)::

    +----------------------+------------------------------------------+
    | length: 4 bytes, BE  | payload: one msgpack map, `length` bytes |
    +----------------------+------------------------------------------+

The payload is packed with ``use_bin_type=True`` and read with ``raw=False`` and
``strict_map_key=True``; a length above ``max_frame_bytes`` is refused with
``frame_too_large`` (and the connection closed), since the rest of the stream can no
longer be trusted.

What a frame may decode to is bounded too, before any Python object is built: a
payload's msgpack headers are walked first (``check_shape``: cost bounded by the budget,
since strings and binaries are stepped over by their length) and refused when it holds
more than ``MAX_OBJECTS`` values or nests deeper than ``MAX_DEPTH``. Without that, one
frame of 32 MiB of empty maps decodes to gigabytes of dicts, or stalls the event loop.

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
    "preflight", "reload", "config", "drain", "count_tokens",
})
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
SESSION_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# What one frame may decode to: a long chat with images is a few thousand values; the
# budget keeps the worst frame's Python objects to a few MiB.
MAX_OBJECTS = 65_536
MAX_DEPTH = 32


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


# Header byte -> (bytes of a length field, fixed payload bytes) for the scalar formats;
# containers, strings and binaries are handled in check_shape.
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
# Formats with a big-endian length field, then that many bytes (+1 for ext's type byte).
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xd9: (1, 0), 0xda: (2, 0),
          0xdb: (4, 0), 0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1)}
# Containers with a length field: (bytes of the count, values per entry).
_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}


def check_shape(payload: bytes, max_objects: int = MAX_OBJECTS,
                max_depth: int = MAX_DEPTH) -> int:
    """Walk the msgpack headers of ``payload`` without building anything; the number of
    values it holds, or ``bad_request`` past the object or depth budget.

    Malformed bytes are left for the decoder to report: the walk only stops early.
    """
    view = memoryview(payload)
    end = len(view)
    pos = objects = 0
    pending: list[int] = []  # values still to read in each open container
    while pos < end:
        if pending:
            pending[-1] -= 1
        objects += 1
        if objects > max_objects:
            raise BadRequest(f"the frame holds more than {max_objects} values")
        b = view[pos]
        pos += 1
        count = 0
        if b <= 0x7f or b >= 0xe0:
            pass
        elif b <= 0x8f:
            count = 2 * (b & 0x0f)
        elif b <= 0x9f:
            count = b & 0x0f
        elif b <= 0xbf:
            pos += b & 0x1f
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            pos += width + extra + int.from_bytes(view[pos:pos + width], "big")
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            count = per * int.from_bytes(view[pos:pos + width], "big")
            pos += width
        else:
            return objects  # 0xc1 (never used): the decoder says what is wrong
        if count:
            if count > max_objects:
                raise BadRequest(f"the frame holds more than {max_objects} values")
            pending.append(count)
            if len(pending) > max_depth:
                raise BadRequest(f"the frame nests deeper than {max_depth} levels")
        while pending and pending[-1] == 0:
            pending.pop()
        if not pending:
            break  # one complete value: anything after it is the decoder's to refuse
    return objects


def unpack(payload: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
           max_objects: int = MAX_OBJECTS) -> Any:
    """A frame's payload -> exactly one msgpack object, or ``bad_request``.

    The shape is checked before decoding (see the module docstring); the decoder's own
    length limits back that up for every container and string.
    """
    check_shape(payload, max_objects)
    try:
        # unpackb reads the payload in place (an Unpacker would copy it into its buffer:
        # one more frame-sized allocation per request).
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True,
                               max_str_len=max_frame_bytes, max_bin_len=max_frame_bytes,
                               max_array_len=max_objects, max_map_len=max_objects,
                               max_ext_len=max_frame_bytes)
    except msgpack.ExtraData as exc:
        raise BadRequest("the frame holds more than one msgpack value") from exc
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the frame holds invalid UTF-8: {exc.reason}") from exc
    except (ValueError, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        if "incomplete input" in str(exc):
            raise BadRequest("the frame ends inside a msgpack value") from exc
        raise BadRequest(f"the frame is not valid msgpack: {exc or type(exc).__name__}") from exc


class FrameBuffer:
    """Incremental reader for a byte stream: ``feed`` bytes, take complete payloads (the
    client's reader; the server reads a header, then exactly the frame, with the same
    ``frame_length`` rule, so that it can bound what it holds before the bytes arrive)."""

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


def preflight_lines(report: dict[str, Any]) -> list[str]:
    """The ``preflight`` result (``{ok, checks, tuning}``) as text, one check a line with
    its remedy under a warning or failure: `qvld preflight` and `qvlctl preflight` alike."""
    lines = []
    for check in report["checks"]:
        lines.append(f"{check['status']:<5} {check['id']:<13} {check['found']}")
        if check.get("remedy") and check["status"] in ("warn", "fail"):
            lines.append(f"      {'':<13} remedy: {check['remedy']}")
    for action in report["tuning"]:
        result = f"{action['result']}: " if action.get("result") else ""
        lines.append(f"tuning {action['action']}: {result}{action['detail']}")
    return lines


def op_label(op: object) -> str:
    """What logs and metrics call an op: a known one, else "unknown" (a client's string
    never becomes a label or log field of its own)."""
    return op if isinstance(op, str) and op in OPS else "unknown"


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


def token_event(rid: int, text: str, token_ids: list[int],
                logprobs: list[dict[str, Any]] | None = None,
                index: int | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"id": rid, "event": "token", "text": text,
                             "token_ids": token_ids}
    if logprobs is not None:  # asked for: one entry per id
        event["logprobs"] = logprobs
    if index is not None:  # n > 1: which choice the tokens are of
        event["index"] = index
    return event
