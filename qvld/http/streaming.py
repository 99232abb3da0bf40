"""A generation over HTTP, the same for every dialect (``Generations.run``): protocol v1
``generate`` dispatched to the handlers, its token events carried from the engine's
threads to the request's handler (``Exchange``, bounded by ``http.max_unsent_events``),
the answer whole or as a stream in the dialect's framing (``Replies``: SSE or NDJSON),
and the end of a generation whose client left (``settle``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiohttp import web

from qvld import protocol
from qvld.config import HttpConfig
from qvld.errors import QvlError
from qvld.http.dialect import Replies
from qvld.server import Peer, RequestContext

log = logging.getLogger("qvld.http")

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


async def send_stream(request: web.Request, replies: Replies, task: asyncio.Future[Any],
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


class Generations:
    """Runs requests through the handlers, as the Unix socket does: ``dispatch`` (the
    app's), request ids from ``ids``, the limits of ``settings()`` (as the last reload
    left them), and ``stopped(request)``: why the daemon ended a generation."""

    def __init__(self, dispatch: Callable[[RequestContext], Awaitable[Any]],
                 ids: Iterator[int], settings: Callable[[], HttpConfig],
                 stopped: Callable[[web.Request], QvlError]) -> None:
        self.dispatch = dispatch
        self.ids = ids
        self.settings = settings
        self.stopped = stopped

    async def call(self, op: str, params: dict[str, Any], peer: Peer) -> Any:
        """A request that answers at once (no token events), e.g. count_tokens."""
        ctx = RequestContext(request=protocol.Request(next(self.ids), op, params),
                             peer=peer, connection=Exchange(1))
        return await self.dispatch(ctx)

    async def run(self, request: web.Request, params: dict[str, Any], stream: bool,
                  replies: Replies, peer: Peer, fields: dict[str, Any]
                  ) -> tuple[web.StreamResponse, str]:
        """Run the generation (protocol v1 ``params``); the response, shaped by the
        dialect's ``replies``, and the outcome to account."""
        config = self.settings()
        rid = next(self.ids)
        exchange = Exchange(config.max_unsent_events)
        ctx = RequestContext(request=protocol.Request(rid, "generate", params),
                             peer=peer, connection=exchange)
        exchange.on_overflow = lambda: _cut_off(request, ctx)
        exchange.in_flight[rid] = ctx
        task = asyncio.ensure_future(self.dispatch(ctx))
        try:
            if stream:
                response = await send_stream(
                    request, replies, task, exchange, timeout=config.read_timeout_s,
                    send_buffer_bytes=config.send_buffer_bytes,
                    stopped=lambda: self.stopped(request))
            else:
                result = await asyncio.shield(task)
                if result["finish_reason"] == "cancelled":
                    raise self.stopped(request)
                response = web.Response(body=replies.whole(result),
                                        content_type="application/json")
        except asyncio.CancelledError:
            await settle(ctx, task, fields)  # the client left
            raise
        except (asyncio.TimeoutError, ConnectionError) as exc:
            # A stream the client stopped reading (or reset): end it and its generation.
            if isinstance(exc, asyncio.TimeoutError):
                log.warning("HTTP client is not reading its stream (a write waited %g s); "
                            "cutting it off", config.read_timeout_s)
            if request.transport is not None:
                request.transport.abort()
            await settle(ctx, task, fields)
            return web.Response(status=499), "cancelled"
        fields.update(ctx.log_fields)
        return response, ctx.outcome or "ok"


def _cut_off(request: web.Request, ctx: RequestContext) -> None:
    log.warning("HTTP client is not reading its stream; cutting it off")
    ctx.cancel()
    if request.transport is not None:
        request.transport.abort()
