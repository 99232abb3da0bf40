"""A generation's answer over HTTP: its token events carried from the engine's threads
to the request's handler (``Exchange``, bounded by ``http.max_unsent_events``), a
stream in the dialect's framing (``Replies``: SSE or NDJSON), and the end of a
generation whose client left (``settle``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from qvld.errors import QvlError
from qvld.http.dialect import Replies
from qvld.server import RequestContext

END: dict[str, Any] = {}  # closes an exchange's queue of events


class Exchange:
    """One HTTP request's channel: token events from worker threads to its handler."""

    def __init__(self, limit: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.in_flight: dict[int, RequestContext] = {}
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.limit = limit
        self.overflowed = False
        self.on_overflow: Callable[[], None] = lambda: None

    def send_threadsafe(self, message: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self._put, message)

    def _put(self, message: dict[str, Any]) -> None:
        if self.overflowed:
            return
        if self.events.qsize() >= self.limit:
            # The client does not read its stream: cut it off, never buffer without end.
            self.overflowed = True
            self.on_overflow()
            return
        self.events.put_nowait(message)


async def stream(request: web.Request, replies: Replies, task: asyncio.Future[Any],
                 exchange: Exchange, *, timeout: float, send_buffer_bytes: int,
                 stopped: Callable[[], QvlError]) -> web.StreamResponse:
    """A stream in the dialect's framing: the headers go out with the first token,
    so an error before it (a bad image, a prompt too long) is still a plain HTTP
    error."""
    response: web.StreamResponse | None = None
    if request.transport is not None:
        # What a stream may leave in the kernel and in the transport, as on the Unix
        # socket (http.send_buffer_bytes); past it writes wait, events queue up to
        # http.max_unsent_events, and then the client is cut off.
        with contextlib.suppress(OSError, AttributeError):
            request.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
        request.transport.set_write_buffer_limits(high=send_buffer_bytes)

    async def send(data: bytes) -> None:
        nonlocal response
        if response is None:
            response = web.StreamResponse(headers={
                "Content-Type": replies.media_type, "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"})
            await response.prepare(request)
            data = replies.first() + data
        if data:
            # A client that stops reading: the write waits for room at most this long.
            await asyncio.wait_for(response.write(data), timeout)

    # Token events come through the loop before the generation's end does (both are
    # handed over with call_soon_threadsafe, in order), so the end closes the queue.
    task.add_done_callback(lambda _: exchange.events.put_nowait(END))
    while (event := await exchange.events.get()) is not END:
        frames = replies.tokens(event)
        if frames:
            await send(frames)
    try:
        result = task.result()
        if result["finish_reason"] == "cancelled":  # by a drain: the client is here
            raise stopped()
    except QvlError as exc:
        if response is None:
            raise
        await send(replies.failed(exc))
        await response.write_eof()
        return response
    await send(replies.last(result))
    assert response is not None
    await response.write_eof()
    return response


async def settle(ctx: RequestContext, task: asyncio.Future[Any],
                  fields: dict[str, Any]) -> None:
    """Cancel a generation whose client is gone and wait for it to stop (at its next
    step), so that its log line says what it generated."""
    ctx.cancel()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), 30)
    fields.update(ctx.log_fields)
