"""Request bodies: what reading and decoding one may cost the daemon.

- **Bytes held.** A body is read into memory whole (a data URL is one JSON string), so
  what all connections hold at once is bounded: ``http.max_pending_bytes`` in all, and
  at most ``http.max_body_bytes`` per user, reserved chunk by chunk as bytes arrive
  (``Content-Length`` only refuses a body over the limit before a byte is read: an
  announcement holds nothing) and given back once the body is decoded; a user holding
  none may use a headroom past the total (``PendingBytes``). Past either, the request
  is refused at once (503 for the total, 429 for the user's share). The refused body's
  remaining bytes are read and dropped by aiohttp's lingering close, so a client still
  sending reads the answer instead of a reset.
- **Work before decoding.** ``json.loads`` holds the GIL for the whole document and
  builds every value: 32 MiB of ``[[],[],...]`` is 11 M lists, seconds of a stalled event
  loop and most of a GiB. ``check_json_shape`` walks the bytes first, with NumPy on
  256 KiB slices (the GIL released, the walk stopping at the first slice over budget), and
  refuses a body of more than ``MAX_VALUES`` values or ``MAX_DEPTH`` levels, as the
  socket's ``protocol.check_shape`` does for msgpack. Strings may be as long as the body
  (an image data URL is one). Bodies past ``INLINE_BYTES`` are walked and decoded on a
  thread of the HTTP front's own, never on the event loop.
- **Sent as is.** A compressed body (``Content-Encoding`` gzip, deflate, br...) is a
  415 before it is read: every bound above counts bytes as they arrive, and inflating
  multiplies them (510 KB of gzip inflated to 512 MiB).
- **Text.** The body must be UTF-8 (strictly: no encoded surrogates) and no string in it
  may hold a lone surrogate (``"\\ud800"``, which JSON's escapes allow and nothing
  downstream can encode): both are a 400.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mmap
import time
from collections.abc import Mapping
from concurrent.futures import Executor
from typing import Any

import numpy as np
from aiohttp import web

from qvld.errors import BadRequest, Busy, FrameTooLarge, QvlError
from qvld.protocol import MAX_OBJECTS
from qvld.server import PendingBytes

# The socket's budget of values per request; JSON Schemas nest deeper than msgpack
# frames need to (response_format schemas up to 64 levels, inside the body's own).
MAX_VALUES = MAX_OBJECTS
MAX_DEPTH = 128
INLINE_BYTES = 64 << 10
_SLICE = 256 << 10  # its index arrays are 2 MiB each
_QUOTE, _BACKSLASH = 0x22, 0x5C
_OPEN, _CLOSE, _SEPARATOR = (np.zeros(256, dtype=bool) for _ in range(3))
_OPEN[[ord("["), ord("{")]] = True
_CLOSE[[ord("]"), ord("}")]] = True
_SEPARATOR[[ord(","), ord(":")]] = True
_STRUCTURAL = _OPEN | _CLOSE | _SEPARATOR


class BodyTooLarge(FrameTooLarge):
    """Over http.max_body_bytes (HTTP 413)."""


class BodyStalled(QvlError):
    code = "bad_request"
    http_status = 408


class EncodedBody(QvlError):
    """A body sent compressed (``Content-Encoding`` other than identity): refused with 415
    before a byte of it is read. Inflating would let 0.5 MB on the wire become 512 MiB in
    memory past every bound above, which count bytes as sent (aiohttp's own inflating is
    off: the HTTP front's runner sets ``auto_decompress=False``)."""

    code = "bad_request"
    http_status = 415


def check_content_encoding(headers: Mapping[str, str]) -> None:
    """EncodedBody unless the request's body, if any, is sent as is."""
    encoding = headers.get("Content-Encoding", "")
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip()]
    if any(c != "identity" for c in codings):
        raise EncodedBody(f"Content-Encoding {encoding.strip()!r} is not accepted: send "
                          "the body uncompressed (Content-Encoding: identity, or none)")


class Overloaded(Busy):
    """The daemon holds http.max_pending_bytes of bodies already: any instance but this
    one could take the request (HTTP 503, retryable)."""

    http_status = 503


def check_json_shape(data: bytes | bytearray | memoryview, max_values: int = MAX_VALUES,
                     max_depth: int = MAX_DEPTH) -> int:
    """An upper bound on the values (keys included) the JSON text ``data`` decodes to,
    or ``bad_request`` past ``max_values`` or deeper than ``max_depth``.

    Every value but the first follows a ``[``, ``{``, ``,`` or ``:`` outside a string,
    so one plus their count bounds the values (exactly, when no container is empty).
    Strings are told apart by their unescaped quotes: a quote after an odd run of
    backslashes is inside a string. Exact up to the first syntax error, which the
    decoder then reports having built no more than this.
    """
    view = np.frombuffer(data, dtype=np.uint8)
    values, depth = 1, 0
    in_string = False
    backslashes = 0  # the run of backslashes that ended the previous slice
    for start in range(0, len(view), _SLICE):
        part = view[start:start + _SLICE]
        quotes = np.flatnonzero(part == _QUOTE)
        is_backslash = part == _BACKSLASH
        if is_backslash.any():
            # For each byte, the index of the last byte at or before it that is not a
            # backslash (-1: none in this slice): a quote's run is the distance to it.
            last_plain = np.maximum.accumulate(
                np.where(is_backslash, -1, np.arange(part.size)))
            if quotes.size:
                before = quotes - 1
                plain = np.where(before >= 0, last_plain[np.maximum(before, 0)], -1)
                # A run that reaches the slice's start continues the previous one's.
                run = before - plain + np.where(plain < 0, backslashes, 0)
                quotes = quotes[run % 2 == 0]
            tail_plain = int(last_plain[-1])
            backslashes = part.size - 1 - tail_plain + (backslashes if tail_plain < 0
                                                         else 0)
        else:
            if backslashes % 2 and quotes.size and quotes[0] == 0:
                quotes = quotes[1:]  # escaped by the previous slice's last backslash
            backslashes = 0
        structural = np.flatnonzero(_STRUCTURAL[part])
        if structural.size:
            # Outside a string: an even number of quotes before it (plus the carry).
            inside = (np.searchsorted(quotes, structural) + in_string) % 2 == 1
            marks = part[structural[~inside]]
            opens = _OPEN[marks]
            values += int(opens.sum()) + int(_SEPARATOR[marks].sum())
            if values > max_values:
                raise BadRequest(f"the request body holds more than {max_values} JSON "
                                 "values")
            steps = opens.astype(np.int64) - _CLOSE[marks]
            if steps.size:
                levels = np.cumsum(steps) + depth
                if int(levels.max()) > max_depth:
                    raise BadRequest(f"the request body nests deeper than {max_depth} "
                                     "levels")
                depth = int(levels[-1])
        in_string = bool((quotes.size + in_string) % 2)
    return values


def _no_lone_surrogates(value: Any) -> None:
    """BadRequest if any string or key holds a surrogate code point (JSON's ``\\ud800``
    escapes decode to one; pairs decode to a real character). ASCII strings, a data
    URL among them, are known clean without reading them."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings = (item,)
        elif isinstance(item, dict):
            strings = tuple(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for text in strings:
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise BadRequest("the request body holds invalid Unicode: a lone "
                                     f"surrogate \\u{ord(text[exc.start]):04x} (only "
                                     "pairs make a character)") from None


class DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all distinct: a repeated key would silently keep its
    last value (one reader of the body seeing another request than another does)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(f"the key {key!r} appears twice in one object")
            seen.add(key)
    return out


def decode_json(data: bytes | bytearray | memoryview) -> Any:
    """A request body -> its JSON value, or ``bad_request`` (see the module docstring).
    The walk comes first: a refused body is never copied into a str."""
    check_json_shape(data)
    try:
        text = str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 ({exc.reason} at byte "
                         f"{exc.start})") from None
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    _no_lone_surrogates(value)
    return value


class BodyReader:
    """Reads and decodes JSON bodies within the byte budget (one per HTTP front)."""

    def __init__(self, max_body_bytes: int, max_pending_bytes: int, read_timeout_s: float,
                 executor: Executor) -> None:
        self.budget = PendingBytes(max_pending_bytes, max_body_bytes)
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.executor = executor

    def reconfigure(self, max_body_bytes: int, max_pending_bytes: int,
                    read_timeout_s: float) -> None:
        self.budget.total, self.budget.per_uid = max_pending_bytes, max_body_bytes
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    def _reserve(self, user: int, n: int) -> None:
        budget = self.budget
        if budget.reserve(user, n):
            return
        if budget.held + n > budget.total:
            raise Overloaded(f"the daemon is receiving too many request bodies at once "
                             f"(http.max_pending_bytes, {budget.total} bytes); retry")
        raise Busy(f"this user's request bodies being received pass http.max_body_bytes "
                   f"({budget.per_uid} bytes) together; retry when one is answered")

    async def read_json(self, request: web.Request, user: int) -> Any:
        """The body of ``request`` from ``user`` (a key of the per-user share), decoded."""
        limit = self.max_body_bytes
        announced = request.content_length
        if announced is not None and announced > limit:
            raise BodyTooLarge(f"the request body is {announced} bytes; at most {limit} "
                               "(http.max_body_bytes)")
        held = _Held(self, user)
        buffer = _Buffer(announced)
        try:
            body = await self._read(request, buffer, limit, held)
            if not body:
                raise BadRequest("the request body is empty; send a JSON object")
            if len(body) <= INLINE_BYTES:
                return decode_json(body)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.executor, decode_json, body)
        finally:
            buffer.close()
            held.release()

    async def _read(self, request: web.Request, buffer: _Buffer, limit: int,
                    held: _Held) -> memoryview:
        # The budget is reserved as bytes arrive, not as announced: a head announcing
        # 32 MiB and sending nothing holds none of it.
        deadline = time.monotonic() + self.read_timeout_s
        while True:
            try:
                chunk = await asyncio.wait_for(request.content.readany(),
                                               max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise BodyStalled(f"the request body did not arrive within "
                                  f"{self.read_timeout_s:g} s") from None
            if not chunk:
                break
            if buffer.filled + len(chunk) > limit:
                raise BodyTooLarge(f"the request body is over {limit} bytes "
                                   "(http.max_body_bytes)")
            held.add(len(chunk))
            buffer.append(chunk)
        return buffer.view()


class _Buffer:
    """A body's bytes. An announced length is mapped once, anonymous and unwritten: its
    pages are the kernel's zero pages until bytes arrive, so memory grows with what
    arrived, nothing is copied as it grows, and closing it gives every page back to the
    system at once (a heap buffer grown chunk by chunk leaves freed pieces of every size
    behind: +103 MiB kept after 40 bodies). Without a length: a bytearray, grown."""

    def __init__(self, announced: int | None) -> None:
        self.mapped = mmap.mmap(-1, announced) if announced else None
        self.grown = bytearray()
        self.filled = 0
        self._view: memoryview | None = None

    def append(self, chunk: bytes) -> None:
        if self.mapped is None:
            self.grown += chunk
        else:  # aiohttp stops at Content-Length: this never writes past the map
            self.mapped[self.filled:self.filled + len(chunk)] = chunk
        self.filled += len(chunk)

    def view(self) -> memoryview:
        """The bytes received (valid until ``close``)."""
        whole = self.mapped if self.mapped is not None else self.grown
        self._view = memoryview(whole)[:self.filled]
        return self._view

    def close(self) -> None:
        # A view still exported (an error's traceback holding the walk's array) cannot
        # be released now: the map is then unmapped when the last of them goes.
        with contextlib.suppress(BufferError):
            if self._view is not None:
                self._view.release()
            if self.mapped is not None:
                self.mapped.close()


class _Held:
    """One body's share of the budget, given back once (whatever became of it)."""

    def __init__(self, reader: BodyReader, user: int) -> None:
        self.reader = reader
        self.user = user
        self.bytes = 0

    def add(self, n: int) -> None:
        self.reader._reserve(self.user, n)
        self.bytes += n

    def release(self) -> None:
        if self.bytes:
            self.reader.budget.release(self.user, self.bytes)
            self.bytes = 0
