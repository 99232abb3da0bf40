"""The HTTP listener: OpenAI-compatible chat completions on aiohttp.

A second front door onto the same ``Handlers`` the Unix socket uses: a chat-completions
body becomes protocol v1 ``generate`` params (``qvld.http.openai``), runs through the
same prepare stage, scheduler, caches and metrics, and its result or token events come
back as a ``chat.completion`` or as Server-Sent Events.

Identity: a bearer key from ``http.api_keys_file`` names a user; without a keys file
only loopback clients are served, all as the user ``local``. HTTP users get ids above
every uid (``keys.HTTP_USER_ID_BASE``), so a key never stands for root or for a socket
user, and the scheduler, sessions and caches treat each as a user of its own.

What a client can make the daemon hold is bounded as on the socket: connections
(``http.max_connections``; more are answered 503 at once), a request head or body
must arrive within ``http.read_timeout_s`` (aiohttp's keep-alive timer is armed when a
connection opens, so a client that never finishes a head is closed then), the body's
size (``http.max_body_bytes``, 413), and token events a streaming client leaves unread
(``http.max_unsent_events``: past it the stream is cut and the generation cancelled).
A client that disconnects cancels its generation (aiohttp cancels the handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from qvld import protocol
from qvld.config import Config, HttpConfig
from qvld.errors import (
    BadRequest,
    Busy,
    Forbidden,
    InternalError,
    QvlError,
    Unavailable,
)
from qvld.handlers import DaemonState
from qvld.http import openai
from qvld.http.fetch import ImageFetcher, normalize_host_pattern
from qvld.http.keys import ApiKeys, KeyFileError, UserIds, parse_bearer
from qvld.logfields import log_request
from qvld.metrics import Metrics
from qvld.server import Peer, RequestContext

log = logging.getLogger("qvld.http")

LOCAL_USER = "local"
SESSION_HEADER = "X-Qvld-Session"
JSON = "application/json"
# on_reply(op, outcome, seconds, user id): the app's accounting, shared with the socket.
OnReply = Callable[[str, str, float, int], None]


class Unauthorized(QvlError):
    """No key, or one the keys file does not hold (HTTP 401)."""

    code = "invalid_api_key"


class HttpSetupError(Exception):
    """What keeps the HTTP section from being applied: every problem, one per line."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def load_http(config: HttpConfig) -> ApiKeys | None:
    """The keys file's keys (None: loopback clients only), with the fetch allow-lists
    checked too; raises HttpSetupError, so a start fails and a reload keeps the old."""
    errors = []
    keys = None
    if config.api_keys_file is not None:
        try:
            keys = ApiKeys.load(config.api_keys_file)
        except KeyFileError as exc:
            errors += [f"http.api_keys_file: {line}" for line in exc.errors]
    if config.fetch_image_urls:
        for pattern in (*config.fetch_allow_hosts, *config.fetch_allow_private):
            try:
                normalize_host_pattern(pattern)
            except ValueError as exc:
                errors.append(f"http.fetch_allow_hosts/fetch_allow_private: {exc}")
    if errors:
        raise HttpSetupError(errors)
    return keys


def _is_loopback(peername: Any) -> bool:
    if not peername:  # a Unix socket passed by systemd: its file mode decides who connects
        return True
    try:
        address = ipaddress.ip_address(str(peername[0]).split("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


_END: dict[str, Any] = {}  # closes an exchange's queue of events


class _Exchange:
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


def _refuse(conn: socket.socket) -> None:
    """A connection past http.max_connections: answered 429 at once, never read."""
    _, body = openai.error_body(Busy("too many connections; retry later"))
    payload = json.dumps(body).encode()
    head = ("HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
            f"Retry-After: 1\r\nConnection: close\r\nContent-Length: {len(payload)}"
            "\r\n\r\n")
    with contextlib.suppress(OSError):  # a fresh socket's buffer takes these bytes at once
        conn.setblocking(False)
        conn.send(head.encode() + payload)
    conn.close()


def _listener(listen: str) -> socket.socket:
    """The listening socket for http.listen (HOST:PORT, [IPv6]:PORT, :PORT)."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    family, _, _, _, address = socket.getaddrinfo(
        host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


class _WireLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's own log: a malformed request is one line, without a traceback (a
    hostile client must not be able to fill the journal with them)."""

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else None
        self.logger.info("malformed HTTP request: %s", error or msg)


class HttpFront:
    def __init__(self, config: Config, state: DaemonState,
                 dispatch: Callable[[RequestContext], Awaitable[Any]], metrics: Metrics,
                 keys: ApiKeys | None, on_reply: OnReply | None = None) -> None:
        self.config = config.http
        self.send_buffer_bytes = config.server.send_buffer_bytes
        self.serve_metrics = not config.metrics.listen
        self.state = state
        self.dispatch = dispatch
        self.metrics = metrics
        self.keys = keys
        self.on_reply = on_reply
        self.users = UserIds()
        self.fetcher = self._fetcher(config.http)
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._ops: dict[Callable[[web.Request], Awaitable[web.StreamResponse]], str] = {}

    @staticmethod
    def _fetcher(config: HttpConfig) -> ImageFetcher | None:
        if not config.fetch_image_urls:
            return None
        return ImageFetcher(config.fetch_allow_hosts, config.fetch_allow_private,
                            config.fetch_max_bytes, config.fetch_timeout_s)

    def reconfigure(self, config: Config, keys: ApiKeys | None) -> None:
        """A reload: new limits, keys and fetch policy; the listener itself stays."""
        old_fetcher = self.fetcher
        self.config = config.http
        self.send_buffer_bytes = config.server.send_buffer_bytes
        self.keys = keys
        self.fetcher = self._fetcher(config.http)
        if old_fetcher is not None:
            self._spawn(old_fetcher.close())

    # -- listening ------------------------------------------------------------------

    async def start(self, sock: socket.socket | None = None) -> None:
        """Serve on ``sock`` (from systemd) or on http.listen."""
        # What metrics and logs call each route (the chat completions are "generate").
        self._ops = {self.chat_completions: "generate", self.models: "models",
                     self.health: "health", self.metrics_text: "metrics"}
        app = web.Application(middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.models)
        app.router.add_get("/health", self.health)
        if self.serve_metrics:
            app.router.add_get("/metrics", self.metrics_text)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True,
            keepalive_timeout=self.config.read_timeout_s, max_field_size=8190,
            max_headers=64, lingering_time=0, logger=_WireLog(log, {}))
        await self._runner.setup()
        if sock is None:
            assert self.config.listen is not None
            sock = _listener(self.config.listen)
        sock.setblocking(False)
        self._listener = sock
        self._accepting = asyncio.create_task(self._accept(sock))
        if self.keys is None:
            log.warning("HTTP API on %s: no http.api_keys_file, so only loopback clients "
                        "are served, all as the user %r", self.address, LOCAL_USER)
        else:
            log.info("HTTP API on %s (%d API keys)", self.address, len(self.keys))

    async def _accept(self, listener: socket.socket) -> None:
        """Accept one connection at a time, so that the count of connections is exact
        when the next one is judged (asyncio's own server accepts a whole backlog before
        any of them is counted); past http.max_connections, answer 429 and close."""
        loop = asyncio.get_running_loop()
        assert self._runner is not None and self._runner.server is not None
        server = self._runner.server
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of descriptors: let some close first
                log.warning("HTTP: cannot accept a connection: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if len(server.connections) >= self.config.max_connections:
                _refuse(conn)
                continue
            try:
                await loop.connect_accepted_socket(server, conn)
            except OSError:
                conn.close()

    @property
    def address(self) -> str:
        assert self._listener is not None
        name = self._listener.getsockname()
        if isinstance(name, tuple):
            host = f"[{name[0]}]" if ":" in name[0] else name[0]
            return f"http://{host}:{name[1]}"
        return f"http+unix:{name}"

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    async def stop_accepting(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def close(self) -> None:
        await self.stop_accepting()
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._runner.cleanup(), 10)
            self._runner = None
        if self.fetcher is not None:
            await self.fetcher.close()
        if self._pending:
            await asyncio.wait(self._pending, timeout=5)

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- requests -------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        """Every request accounted once (its op, user, outcome and log fields, which the
        handler leaves on the request), every failure in OpenAI's error shape."""
        t0 = time.monotonic()
        op = self._ops.get(handler, "unknown")
        request["fields"] = {}
        outcome = "ok"
        try:
            response = await handler(request)
            outcome = request.get("outcome", "ok")
            return response
        except web.HTTPException as exc:  # the router's 404 and 405
            outcome = {404: "not_found", 405: "method_not_allowed"}.get(exc.status,
                                                                        "bad_request")
            message = f"{request.method} {request.path} is not served here" \
                if exc.status in (404, 405) else exc.reason
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return _error_response(*openai.error_body(code=outcome, message=message),
                                   headers=allow)
        except QvlError as exc:
            outcome = exc.code
            response = _error_response(*openai.error_body(exc))
            if isinstance(exc, (_TooLarge, _Stalled)):
                response.force_close()  # the rest of the body is not read
            return response
        except asyncio.CancelledError:
            outcome = "cancelled"  # the client left
            raise
        except Exception:
            outcome = "internal"
            rid = next(self._ids)
            log.exception("internal error in HTTP request %d", rid)
            return _error_response(*openai.error_body(InternalError(
                f"internal error (logged as HTTP request {rid})")))
        finally:
            self._account(request, op, outcome, t0, request.get("user"), request["fields"])

    def _user(self, request: web.Request) -> str:
        """Who is asking: the key's user, or ``local`` on a listener without keys."""
        if self.keys is None:
            if not _is_loopback(request.transport and
                                request.transport.get_extra_info("peername")):
                raise Forbidden("this listener serves loopback clients only (no "
                                "http.api_keys_file is configured)")
            request["user"] = LOCAL_USER
            return LOCAL_USER
        key = parse_bearer(request.headers.get("Authorization"))
        if key is None:
            raise Unauthorized("an API key is needed: Authorization: Bearer <key>")
        user = self.keys.user(key)
        if user is None:
            raise Unauthorized("the API key is not valid")
        request["user"] = user
        return user

    def _peer(self, user: str) -> Peer:
        uid = self.users.id(user)
        return Peer(pid=0, uid=uid, gid=uid, groups=frozenset())

    def _account(self, request: web.Request, op: str, outcome: str, t0: float,
                 user: str | None, fields: dict[str, Any] | None = None) -> None:
        seconds = time.monotonic() - t0
        self.metrics.observe_request(op, outcome, seconds, api="http")
        if op == "health":
            return  # probes every few seconds would drown the journal and last errors
        uid = self.users.id(user) if user is not None else -1
        if self.on_reply is not None:
            self.on_reply(op, outcome, seconds, uid)
        path = request.path if op != "unknown" else "-"
        log_request("http %s %s user=%s op=%s outcome=%s time=%.3fs", (
            request.method, path, user or "-", op, outcome, seconds), {
            "api": "http", "method": request.method, "path": path, "user": user,
            "op": op, "outcome": outcome, "time_s": round(seconds, 6), **(fields or {})},
            logger=log)

    async def _read_json(self, request: web.Request) -> Any:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise _TooLarge(f"the request body is {request.content_length} bytes; at most "
                            f"{limit} (http.max_body_bytes)")
        body = bytearray()
        deadline = time.monotonic() + self.config.read_timeout_s
        while True:
            try:
                chunk = await asyncio.wait_for(request.content.readany(),
                                               max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise _Stalled(f"the request body did not arrive within "
                               f"{self.config.read_timeout_s:g} s") from None
            if not chunk:
                break
            body += chunk
            if len(body) > limit:
                raise _TooLarge(f"the request body is over {limit} bytes "
                                "(http.max_body_bytes)")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        user = self._user(request)
        body = await self._read_json(request)
        session = request.headers.get(SESSION_HEADER)
        if session is not None and not protocol.SESSION_ID.fullmatch(session):
            raise openai.bad(SESSION_HEADER, f"{SESSION_HEADER} must be 1-128 "
                             "characters of [A-Za-z0-9._-]")
        chat = openai.parse_chat(body, session, self.config.low_detail_image_tokens)
        fields = request["fields"]
        if chat.user is not None:
            fields["end_user"] = json.dumps(chat.user)
        await self._fetch_images(chat)
        response, request["outcome"] = await self._generate(request, chat,
                                                            self._peer(user), fields)
        return response

    async def _fetch_images(self, chat: openai.ChatRequest) -> None:
        if not chat.remote_images:
            return
        if self.fetcher is None:
            raise openai.bad("messages", "this server does not fetch image URLs "
                             "(http.fetch_image_urls is off); send images as data: URLs")
        for image in chat.remote_images:
            image.part["image"] = await self.fetcher.fetch(image.url, _not_an_image)

    async def _generate(self, request: web.Request, chat: openai.ChatRequest, peer: Peer,
                        fields: dict[str, Any]) -> tuple[web.StreamResponse, str]:
        """Run the generation; the response and the outcome to account."""
        cid, created = openai.completion_id(), int(time.time())
        model = self._model_name()
        rid = next(self._ids)
        exchange = _Exchange(self.config.max_unsent_events)
        ctx = RequestContext(request=protocol.Request(rid, "generate", chat.params),
                             peer=peer, connection=exchange)
        exchange.on_overflow = lambda: self._cut_off(request, ctx)
        exchange.in_flight[rid] = ctx
        task = asyncio.ensure_future(self.dispatch(ctx))
        try:
            if chat.stream:
                response = await self._stream(request, chat, ctx, task, exchange,
                                              (cid, created, model))
            else:
                result = await asyncio.shield(task)
                if result["finish_reason"] == "cancelled":
                    raise Unavailable("the daemon stopped this generation (it is "
                                      "shutting down); retry")
                response = web.json_response(openai.completion(result, cid, created, model))
        except asyncio.CancelledError:
            await _settle(ctx, task, fields)  # the client left
            raise
        except (asyncio.TimeoutError, ConnectionError) as exc:
            # A stream the client stopped reading (or reset): end it and its generation.
            if isinstance(exc, asyncio.TimeoutError):
                log.warning("HTTP client is not reading its stream (a write waited %g s); "
                            "cutting it off", self.config.read_timeout_s)
            if request.transport is not None:
                request.transport.abort()
            await _settle(ctx, task, fields)
            return web.Response(status=499), "cancelled"
        fields.update(ctx.log_fields)
        return response, ctx.outcome or "ok"

    def _cut_off(self, request: web.Request, ctx: RequestContext) -> None:
        log.warning("HTTP client is not reading its stream; cutting it off")
        ctx.cancel()
        if request.transport is not None:
            request.transport.abort()

    async def _stream(self, request: web.Request, chat: openai.ChatRequest,
                      ctx: RequestContext, task: asyncio.Future[Any], exchange: _Exchange,
                      ident: tuple[str, int, str]) -> web.StreamResponse:
        """Server-Sent Events: the headers go out with the first token, so an error
        before it (a bad image, a prompt too long) is still a plain HTTP error."""
        response: web.StreamResponse | None = None
        timeout = self.config.read_timeout_s
        if request.transport is not None:
            # What a stream may leave in the kernel and in the transport, as on the Unix
            # socket (server.send_buffer_bytes); past it writes wait, events queue up to
            # http.max_unsent_events, and then the client is cut off.
            with contextlib.suppress(OSError, AttributeError):
                request.transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            request.transport.set_write_buffer_limits(high=self.send_buffer_bytes)

        async def send(*events: dict[str, Any] | str) -> None:
            nonlocal response
            if response is None:
                response = web.StreamResponse(headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no"})
                await response.prepare(request)
                events = (openai.chunk(*ident, {"role": "assistant", "content": ""}),
                          *events)
            data = b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(
                e, ensure_ascii=False)).encode() + b"\n\n" for e in events)
            # A client that stops reading: the write waits for room at most this long.
            await asyncio.wait_for(response.write(data), timeout)

        # Token events come through the loop before the generation's end does (both are
        # handed over with call_soon_threadsafe, in order), so the end closes the queue.
        task.add_done_callback(lambda _: exchange.events.put_nowait(_END))
        while (event := await exchange.events.get()) is not _END:
            await send(openai.chunk(*ident, {"content": event["text"]}))
        try:
            result = task.result()
        except QvlError as exc:
            if response is None:
                raise
            await send(openai.error_body(exc)[1])
            await response.write_eof()
            return response
        if result["finish_reason"] == "cancelled":  # by a drain: the client is still here
            stopped = Unavailable("the daemon stopped this generation (it is shutting "
                                  "down); retry")
            if response is None:
                raise stopped
            await send(openai.error_body(stopped)[1])
            await response.write_eof()
            return response
        tail: list[dict[str, Any] | str] = [openai.chunk(*ident, {},
                                                         result["finish_reason"])]
        if chat.include_usage:
            tail.append(openai.usage_chunk(result, *ident))
        await send(*tail, "[DONE]")
        assert response is not None
        await response.write_eof()
        return response

    def _model_name(self) -> str:
        engine = self.state.engine
        return engine.spec.name if engine is not None else "qvld"

    async def models(self, request: web.Request) -> web.StreamResponse:
        self._user(request)
        engine = self.state.require_engine()
        entry = {"id": engine.spec.name, "object": "model",
                 "created": int(time.time() - (time.monotonic() - self.state.started)),
                 "owned_by": "qvld", "input_modalities": ["text", "image"],
                 "output_modalities": ["text"],
                 "context_length": engine.stats()["max_context_tokens"],
                 "max_completion_tokens": self.state.config.engine.max_new_tokens}
        wanted = request.match_info.get("model")
        if wanted is None:
            return web.json_response({"object": "list", "data": [entry]})
        if wanted != entry["id"]:
            request["outcome"] = "not_found"
            return _error_response(*openai.error_body(
                code="not_found", message=f"model {wanted!r} is not served here; "
                f"this server serves {entry['id']!r}", param="model"))
        return web.json_response(entry)

    async def health(self, request: web.Request) -> web.StreamResponse:
        """For load balancers and probes, without a key: 200 while generations are
        served (a reload keeps serving the old model), else 503."""
        state = self.state
        serving = state.engine is not None and state.state in ("ready", "reloading")
        body = {"status": state.state, "ready": serving}
        if serving:
            return web.json_response(body)
        request["outcome"] = "unavailable"
        return web.json_response(body, status=503, headers={"Retry-After": "1"})

    async def metrics_text(self, request: web.Request) -> web.StreamResponse:
        self._user(request)
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.metrics.registry),
                            headers={"Content-Type": content_type})


class _TooLarge(QvlError):
    code = "frame_too_large"  # 413


class _Stalled(QvlError):
    code = "bad_request"
    http_status = 408


def _not_an_image(data: bytes) -> str | None:
    return None if openai.image_format(data) is not None else "is not PNG, JPEG, WebP or GIF"


async def _settle(ctx: RequestContext, task: asyncio.Future[Any],
                  fields: dict[str, Any]) -> None:
    """Cancel a generation whose client is gone and wait for it to stop (at its next
    step), so that its log line says what it generated."""
    ctx.cancel()
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), 30)
    fields.update(ctx.log_fields)


def _error_response(status: int, body: dict[str, Any],
                    headers: Any = None) -> web.Response:
    extra = dict(headers or {})
    if status in (429, 503):
        extra["Retry-After"] = "1"
    if status == 401:
        extra["WWW-Authenticate"] = 'Bearer realm="qvld"'
    return web.json_response(body, status=status, headers=extra)
