"""The HTTP front on aiohttp: its lifecycle, the route table and the middleware every
request passes.

A second front door onto the same ``Handlers`` the Unix socket uses. Each dialect's
routes (``qvld.http.routes``) turn a body into protocol v1 params through the dialect's
translation module and run it on the one generation path (``streaming.Generations``):
the same prepare stage, scheduler, caches and metrics, answered whole or streamed in the
dialect's framing. Who is calling is ``callers``; the listening sockets and the accept
loop are ``listener``. The middleware accounts every request once (metrics, the
journal) and answers every failure in the route's dialect's error shape.

What a client can make the daemon hold is bounded as on the socket: connections
(``http.max_connections``; more are answered 429 at once), a request head or body
must arrive within ``http.read_timeout_s`` (aiohttp's keep-alive timer is armed when a
connection opens, so a client that never finishes a head is closed then), the bytes of
bodies being received (``qvld.http.body``: 413 past ``http.max_body_bytes``, 503/429
past ``http.max_pending_bytes`` or a user's share; a refused body is read and dropped
for up to ``http.read_timeout_s`` so that the client reads the answer), what a body
decodes to (walked before decoding, off the event loop), and token events a streaming
client leaves unread (``http.max_unsent_events``: past it the stream is cut and the
generation cancelled). A client that disconnects cancels its generation (aiohttp
cancels the handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from qvld.config import Config, HttpConfig
from qvld.errors import InternalError, QvlError
from qvld.handlers import DaemonState
from qvld.http import openai, sitecheck
from qvld.http.body import BodyReader, check_content_encoding
from qvld.http.callers import Caller, Callers
from qvld.http.dialect import bad
from qvld.http.fetch import ImageFetcher
from qvld.http.keys import ApiKeys
from qvld.http.listener import Connections, WireLog, listen_socket
from qvld.http.media import RemoteImage, image_format
from qvld.http.routes.anthropic import AnthropicRoutes
from qvld.http.routes.daemon import DaemonRoutes
from qvld.http.routes.ollama import OllamaRoutes
from qvld.http.routes.openai import OpenAIRoutes
from qvld.http.routes.responses import ResponsesRoutes
from qvld.http.routing import Handler, Route, error_response
from qvld.http.streaming import Generations
from qvld.logfields import log_request
from qvld.metrics import Metrics
from qvld.server import AccessPolicy, RequestContext

log = logging.getLogger("qvld.http")

# on_reply(op, outcome, seconds, user id): the app's accounting, shared with the socket.
OnReply = Callable[[str, str, float, int], None]
# OpenAI's legacy text completions: a 404 that names the endpoint to use instead.
LEGACY_PATHS = frozenset({"/v1/engines/completions"})


class HttpFront:
    def __init__(self, config: Config, state: DaemonState,
                 dispatch: Callable[[RequestContext], Awaitable[Any]], metrics: Metrics,
                 keys: ApiKeys | None, policy: Callable[[], AccessPolicy],
                 on_reply: OnReply | None = None) -> None:
        self.config = config.http
        self.socket_mode = config.server.socket_mode_bits
        self.state = state
        self.metrics = metrics
        self.on_reply = on_reply
        self.fetcher = self._fetcher(config.http)
        # Identity lookups (the user database may be slow) and large bodies' decoding:
        # never on the event loop, and never more of them at once than this.
        self._executor = ThreadPoolExecutor(4, thread_name_prefix="qvld-http")
        self.bodies = BodyReader(self.config.max_body_bytes, self.config.max_pending_bytes,
                                 self.config.read_timeout_s, self._executor)
        self.connections = Connections(self._executor)
        self.callers = Callers(keys, self.connections, policy)
        self._ids = itertools.count(1)
        self.generations = Generations(dispatch, self._ids, lambda: self.config,
                                       self.callers.stopped)
        self._runner: web.AppRunner | None = None
        self._listener: socket.socket | None = None
        self._owned_path: Path | None = None
        self._accepting: asyncio.Task[None] | None = None
        # http.ollama_listen: another TCP listener onto the same app, and its acceptor.
        self._ollama_listener: tuple[socket.socket, asyncio.Task[None]] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        # The route table: every dialect's routes, and the daemon's own.
        self.routes: list[Route] = [
            *OpenAIRoutes(self).routes(), *AnthropicRoutes(self).routes(),
            *ResponsesRoutes(self).routes(), *OllamaRoutes(self).routes(),
            *DaemonRoutes(self, serve_metrics=not config.metrics.listen).routes()]
        # Each handler's route (its op, API and error shape), for the middleware.
        self._route_of: dict[Handler, Route] = {
            route.handler: route for route in self.routes}
        self._route_of[self.preflight] = Route("OPTIONS", "*", self.preflight, "preflight")

    @property
    def keys(self) -> ApiKeys | None:
        return self.callers.keys

    @staticmethod
    def _fetcher(config: HttpConfig) -> ImageFetcher | None:
        if not config.fetch_image_urls:
            return None
        return ImageFetcher(config.fetch_allow_hosts, config.fetch_allow_private,
                            config.fetch_max_bytes, config.fetch_timeout_s)

    def reconfigure(self, config: Config, keys: ApiKeys | None) -> None:
        """A reload: new limits, keys and fetch policy; the listener itself stays. A key
        no longer in the file ends its user's sessions and generations."""
        old_fetcher = self.fetcher
        self.config = config.http
        self.bodies.reconfigure(config.http.max_body_bytes, config.http.max_pending_bytes,
                                config.http.read_timeout_s)
        self.fetcher = self._fetcher(config.http)
        if old_fetcher is not None:
            self._spawn(old_fetcher.close())
        self.callers.revoke(self.callers.rekey(keys), self.state.engine)

    # -- listening ------------------------------------------------------------------

    async def start(self, sock: socket.socket | None = None) -> None:
        """Serve on ``sock`` (from systemd) or on http.listen."""
        app = web.Application(middlewares=[self._errors])
        app.on_response_prepare.append(self._cors)
        for route in self.routes:
            app.router.add_route(route.method, route.path, route.handler)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, handler_cancellation=True,
            keepalive_timeout=self.config.read_timeout_s, max_field_size=8190,
            # A refused body's rest is read and dropped for up to this long, so that a
            # client still sending reads the refusal instead of a reset.
            max_headers=64, lingering_time=self.config.read_timeout_s,
            # Bodies are never inflated (compressed ones are refused: body.py).
            auto_decompress=False,
            logger=WireLog(log, {}))
        await self._runner.setup()
        if sock is None:
            assert self.config.listen is not None
            sock, self._owned_path = listen_socket(self.config.listen, self.socket_mode)
        sock.setblocking(False)
        self._listener = sock
        self._accepting = asyncio.create_task(self._accept(sock))
        if self.config.ollama_listen:
            extra, _ = listen_socket(self.config.ollama_listen, self.socket_mode)
            extra.setblocking(False)
            self._ollama_listener = (extra, asyncio.create_task(self._accept(extra)))
            log.info("HTTP API also on %s (http.ollama_listen)", self.config.ollama_listen)
        if self.keys is None:
            log.info("HTTP API on %s: no http.api_keys_file, so callers are the local "
                     "users the kernel says they are, allowed as on the socket",
                     self.address)
        else:
            log.info("HTTP API on %s (%d API keys)", self.address, len(self.keys))

    async def _accept(self, listener: socket.socket) -> None:
        assert self._runner is not None and self._runner.server is not None
        await self.connections.accept(listener, self._runner.server,
                                       lambda: self.config.max_connections)

    @property
    def address(self) -> str:
        assert self._listener is not None
        name = self._listener.getsockname()
        if isinstance(name, tuple):
            host = f"[{name[0]}]" if ":" in name[0] else name[0]
            return f"http://{host}:{name[1]}"
        return f"http+unix:{name}"

    @property
    def _listen_names(self) -> list[str]:
        """The addresses the TCP listeners are bound to, as a Host header would name
        them (none for a wildcard address: every interface's name would be a guess)."""
        listeners = [self._listener, self._ollama_listener[0] if self._ollama_listener else None]
        hosts = [str(s.getsockname()[0]) for s in listeners
                 if s is not None and s.family != socket.AF_UNIX]
        return [h for h in hosts if h not in ("0.0.0.0", "::")]

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    async def stop_accepting(self) -> None:
        if self._ollama_listener is not None:
            extra, accepting = self._ollama_listener
            accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await accepting
            extra.close()
            self._ollama_listener = None
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._owned_path is not None:
            self._owned_path.unlink(missing_ok=True)
            self._owned_path = None

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
        self._executor.shutdown(wait=False, cancel_futures=True)

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
        if request.method == "OPTIONS" and isinstance(request.match_info.http_exception,
                                                      web.HTTPMethodNotAllowed):
            handler = self.preflight  # a browser's CORS preflight for a path served here
        route = self._route_of.get(handler)
        op = route.op if route is not None else "unknown"
        api = route.api if route is not None else "http"
        error_body = route.error_body if route is not None else openai.error_body
        request["fields"] = {}
        outcome = "ok"
        try:
            check_content_encoding(request.headers)  # before anything reads the body
            if self.keys is None:  # a web page must not act as its visitor
                sitecheck.check(request.method, request.headers, tcp=_over_tcp(request),
                                own_names=[*self._listen_names, *self.config.allowed_hosts],
                                cors_allow_origins=self.config.cors_allow_origins)
            response = await handler(request)
            outcome = request.get("outcome", "ok")
            return response
        except web.HTTPException as exc:  # the router's 404 and 405
            outcome = {404: "not_found", 405: "method_not_allowed"}.get(exc.status,
                                                                        "bad_request")
            message = f"{request.method} {request.path} is not served here" \
                if exc.status in (404, 405) else exc.reason
            if exc.status == 404 and request.path.rstrip("/") in LEGACY_PATHS:
                message += ("; this server answers chat completions: POST "
                            "/v1/chat/completions with messages")
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return error_response(*error_body(code=outcome, message=message),
                                   headers=allow)
        except QvlError as exc:
            outcome = exc.code
            response = error_response(*error_body(exc))
            if not request.content.is_eof():
                # Refused before its body was read whole: aiohttp reads the rest and
                # drops it (lingering), then closes instead of reading another request.
                response.force_close()
            return response
        except asyncio.CancelledError:
            outcome = "cancelled"  # the client left
            raise
        except Exception:
            outcome = "internal"
            rid = next(self._ids)
            log.exception("internal error in HTTP request %d", rid)
            return error_response(*error_body(InternalError(
                f"internal error (logged as HTTP request {rid})")))
        finally:
            self._account(request, op, outcome, t0, request.get("caller"),
                          request["fields"], api)

    def _allowed_origin(self, request: web.Request) -> str | None:
        origin = request.headers.get("Origin")
        return origin if origin in self.config.cors_allow_origins else None

    async def _cors(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every response to a listed origin names it (errors too, so that the page can
        read them); others get no CORS header, as before."""
        origin = self._allowed_origin(request)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Retry-After, X-Qvld-Session"
        if self.config.cors_allow_origins:
            response.headers.add("Vary", "Origin")  # caches keep answers per origin

    async def preflight(self, request: web.Request) -> web.StreamResponse:
        """A browser's CORS preflight: 204 for a listed origin, else 405 as before."""
        if self._allowed_origin(request) is None:
            raise web.HTTPMethodNotAllowed("OPTIONS", ["GET", "POST"])
        wanted = request.headers.get("Access-Control-Request-Headers")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": wanted or
            "Authorization, Content-Type, X-Qvld-Session, x-api-key, anthropic-version",
            "Access-Control-Max-Age": "600"})

    def _account(self, request: web.Request, op: str, outcome: str, t0: float,
                 caller: Caller | None, fields: dict[str, Any] | None = None,
                 api: str = "http") -> None:
        seconds = time.monotonic() - t0
        self.metrics.observe_request(op, outcome, seconds, api=api)
        if op == "health":
            return  # probes every few seconds would drown the journal and last errors
        if self.on_reply is not None:
            self.on_reply(op, outcome, seconds, caller.peer.uid if caller else -1)
        path = request.path if op != "unknown" else "-"
        who = caller.log_name if caller is not None else "user=-"
        log_request("http %s %s %s op=%s outcome=%s time=%.3fs", (
            request.method, path, who, op, outcome, seconds), {
            "api": api, "method": request.method, "path": path,
            **(dict([caller.name_field]) if caller is not None else {"user": None}),
            "op": op, "outcome": outcome, "time_s": round(seconds, 6), **(fields or {})},
            logger=log)

    async def fetch_images(self, remote: list[RemoteImage]) -> None:
        if not remote:
            return
        if self.fetcher is None:
            raise bad("messages", "this server does not fetch image URLs "
                             "(http.fetch_image_urls is off); send images as data: URLs")
        for image in remote:
            image.part[image.kind] = await self.fetcher.fetch(
                image.url, _not_an_image if image.kind == "image" else None)

    def model_name(self) -> str:
        engine = self.state.engine
        return engine.served.name if engine is not None else "qvld"


def _not_an_image(data: bytes) -> str | None:
    return None if image_format(data) is not None else "is not PNG, JPEG, WebP, GIF or BMP"


def _over_tcp(request: web.Request) -> bool:
    """Whether the request came over TCP (not an HTTP Unix socket)."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family != socket.AF_UNIX
