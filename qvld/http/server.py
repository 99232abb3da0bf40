"""The HTTP listener: OpenAI-compatible chat completions on aiohttp.

A second front door onto the same ``Handlers`` the Unix socket uses: a chat-completions
body becomes protocol v1 ``generate`` params (``qvld.http.openai``), runs through the
same prepare stage, scheduler, caches and metrics, and its result or token events come
back as a ``chat.completion`` or as Server-Sent Events.

Identity (``Caller``): with ``http.api_keys_file``, a bearer key names the user; HTTP
users get ids above every uid (``keys.HTTP_USER_ID_BASE``), so a key never stands for
root or for a socket user. Without a keys file a caller is who the kernel says
(``qvld.http.identity``): the uid owning the client's end of a loopback TCP connection,
or SO_PEERCRED on an HTTP Unix socket, authorised exactly as on the protocol socket
(``server.allow_uids``, ``allow_groups``) and served as that uid: its own sessions,
caches and share of the queue. An ``Authorization`` header is then ignored. Callers
from other hosts need a key.

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
import hashlib
import itertools
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.exposition import choose_encoder

from qvld import __version__, protocol
from qvld.config import Config, HttpConfig
from qvld.errors import (
    Forbidden,
    InternalError,
    QvlError,
    Unavailable,
)
from qvld.handlers import DaemonState
from qvld.http import anthropic, ollama, openai, responses, sitecheck, streaming, webui
from qvld.http.body import BodyReader, check_content_encoding
from qvld.http.dialect import Replies
from qvld.http.fetch import ImageFetcher, normalize_host_pattern
from qvld.http.keys import ApiKeys, KeyFileError, UserIds, parse_bearer
from qvld.http.listener import Connections, WireLog, listen_socket
from qvld.http.streaming import Exchange, settle
from qvld.logfields import log_request
from qvld.metrics import Metrics
from qvld.server import AccessPolicy, Peer, RequestContext

log = logging.getLogger("qvld.http")

SESSION_HEADER = "X-Qvld-Session"
JSON = "application/json"
# on_reply(op, outcome, seconds, user id): the app's accounting, shared with the socket.
OnReply = Callable[[str, str, float, int], None]
# A dialect's error answer: (HTTP status, body) for a qvld error or an HTTP-level one.
ErrorShape = Callable[..., tuple[int, dict[str, Any]]]


# OpenAI's legacy text completions: a 404 that names the endpoint to use instead.
LEGACY_PATHS = frozenset({"/v1/engines/completions"})


@dataclass(frozen=True)
class Caller:
    """Who an HTTP request comes from: the peer the handlers, scheduler, sessions and
    caches key on, and how logs name it: ``user`` (a key's name) or ``uid``."""

    peer: Peer
    name_field: tuple[str, str | int]

    @property
    def log_name(self) -> str:
        return "{}={}".format(*self.name_field)


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



class HttpFront:
    def __init__(self, config: Config, state: DaemonState,
                 dispatch: Callable[[RequestContext], Awaitable[Any]], metrics: Metrics,
                 keys: ApiKeys | None, policy: Callable[[], AccessPolicy],
                 on_reply: OnReply | None = None) -> None:
        self.config = config.http
        self.send_buffer_bytes = config.http.send_buffer_bytes
        self.socket_mode = config.server.socket_mode_bits
        self.serve_metrics = not config.metrics.listen
        self.state = state
        self.dispatch = dispatch
        self.metrics = metrics
        self.keys = keys
        self.on_reply = on_reply
        # The socket's access decision, as it stands after the last reload.
        self.policy = policy
        self.users = UserIds()
        self.fetcher = self._fetcher(config.http)
        # Identity lookups (the user database may be slow) and large bodies' decoding:
        # never on the event loop, and never more of them at once than this.
        self._executor = ThreadPoolExecutor(4, thread_name_prefix="qvld-http")
        self.bodies = BodyReader(self.config.max_body_bytes, self.config.max_pending_bytes,
                                 self.config.read_timeout_s, self._executor)
        self.connections = Connections(self._executor)
        # Users whose key was revoked while the daemon ran: a generation of theirs that
        # was cancelled for it is answered 401, not "retry".
        self._revoked_uids: set[int] = set()
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._listener: socket.socket | None = None
        self._owned_path: Path | None = None
        self._accepting: asyncio.Task[None] | None = None
        # http.ollama_listen: another TCP listener onto the same app, and its acceptor.
        self._ollama_listener: tuple[socket.socket, asyncio.Task[None]] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._ops: dict[Callable[[web.Request], Awaitable[web.StreamResponse]], str] = {}
        self.kept_responses = responses.Responses()  # for previous_response_id
        # The routes of another API dialect: its name (the metrics' api label) and the
        # shape of its errors. The rest are the OpenAI API's (api "http").
        self._dialects: dict[Callable[[web.Request], Awaitable[web.StreamResponse]],
                             tuple[str, ErrorShape]] = {}
        self._assets = webui.load_assets()

    @staticmethod
    def _fetcher(config: HttpConfig) -> ImageFetcher | None:
        if not config.fetch_image_urls:
            return None
        return ImageFetcher(config.fetch_allow_hosts, config.fetch_allow_private,
                            config.fetch_max_bytes, config.fetch_timeout_s)

    def reconfigure(self, config: Config, keys: ApiKeys | None) -> None:
        """A reload: new limits, keys and fetch policy; the listener itself stays. A key
        no longer in the file ends its user's sessions."""
        old_fetcher, old_keys = self.fetcher, self.keys
        self.config = config.http
        self.send_buffer_bytes = config.http.send_buffer_bytes
        self.keys = keys
        self.bodies.reconfigure(config.http.max_body_bytes, config.http.max_pending_bytes,
                                config.http.read_timeout_s)
        self.fetcher = self._fetcher(config.http)
        if old_fetcher is not None:
            self._spawn(old_fetcher.close())
        if old_keys is not None:
            kept = dict(keys.users_by_hash) if keys is not None else {}
            self._end_revoked({h: n for h, n in old_keys.users_by_hash.items()
                               if kept.get(h) != n})

    def _end_revoked(self, revoked: dict[str, str]) -> None:
        """Close the sessions of keys (hash -> name) taken out of the keys file."""
        if not revoked:
            return
        engine = self.state.engine
        ended = cancelled = 0
        for key_hash, name in revoked.items():
            uid = self.users.known(name, key_hash)
            if uid is not None and engine is not None:
                ended += engine.close_user_sessions(uid)
                # Its generations in flight end too: a revoked key gets nothing more.
                self._revoked_uids.add(uid)
                for gen in engine.generations():
                    if gen.uid == uid:
                        engine.cancel(gen)
                        cancelled += 1
        log.info("API keys revoked: %s (sessions ended: %d, generations cancelled: %d)",
                 ", ".join(sorted(revoked.values())), ended, cancelled)

    # -- listening ------------------------------------------------------------------

    async def start(self, sock: socket.socket | None = None) -> None:
        """Serve on ``sock`` (from systemd) or on http.listen."""
        # What metrics and logs call each route (the chat completions are "generate").
        self._ops = {self.chat_completions: "generate", self.models: "models",
                     self.health: "health", self.metrics_text: "metrics",
                     self.preflight: "preflight", self.web_page: "web",
                     self.messages: "generate", self.ollama_chat: "generate",
                     self.ollama_generate: "generate", self.ollama_tags: "models",
                     self.ollama_show: "models", self.ollama_ps: "models",
                     self.ollama_version: "models", self.responses: "generate",
                     self.stored_response: "models", self.completions: "generate",
                     self.count_tokens: "count_tokens"}
        self._dialects = {self.messages: ("anthropic", anthropic.error_body),
                          self.count_tokens: ("anthropic", anthropic.error_body),
                          self.responses: ("responses", openai.error_body),
                          self.stored_response: ("responses", openai.error_body),
                          **{handler: ("ollama", ollama.error_body) for handler in (
                              self.ollama_chat, self.ollama_generate, self.ollama_tags,
                              self.ollama_show, self.ollama_ps, self.ollama_version)}}
        app = web.Application(middlewares=[self._errors])
        app.on_response_prepare.append(self._cors)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{id}", self.stored_response)
        app.router.add_delete("/v1/responses/{id}", self.stored_response)
        app.router.add_post("/api/chat", self.ollama_chat)
        app.router.add_post("/api/generate", self.ollama_generate)
        app.router.add_get("/api/tags", self.ollama_tags)
        app.router.add_post("/api/show", self.ollama_show)
        app.router.add_get("/api/ps", self.ollama_ps)
        app.router.add_get("/api/version", self.ollama_version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.models)
        app.router.add_get("/health", self.health)
        if self.serve_metrics:
            app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/", self.web_page)  # http.web_ui, checked per request
        app.router.add_get("/ui/{name}", self.web_page)
        app.router.add_get("/favicon.ico", self.web_page)
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

    def _stopped(self, request: web.Request) -> QvlError:
        """Why the daemon, not the client, ended a generation: its key was revoked, or
        the daemon is shutting down."""
        caller = request.get("caller")
        if caller is not None and caller.peer.uid in self._revoked_uids:
            return Unauthorized("the API key was revoked while this generation ran")
        return Unavailable("the daemon stopped this generation (it is shutting down); "
                           "retry")


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
        op = self._ops.get(handler, "unknown")
        error_body: ErrorShape
        api, error_body = self._dialects.get(handler, ("http", openai.error_body))
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
            return _error_response(*error_body(code=outcome, message=message),
                                   headers=allow)
        except QvlError as exc:
            outcome = exc.code
            response = _error_response(*error_body(exc))
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
            return _error_response(*error_body(InternalError(
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

    async def _caller(self, request: web.Request) -> Caller:
        """Who is asking (see the module docstring), or 401/403."""
        if self.keys is not None:
            # Anthropic's clients send theirs as x-api-key.
            key = parse_bearer(request.headers.get("Authorization")) \
                or request.headers.get("x-api-key") or None
            if key is None:
                raise Unauthorized("an API key is needed: Authorization: Bearer <key> "
                                   "(or x-api-key: <key>)")
            found = self.keys.identify(key)
            if found is None:
                raise Unauthorized("the API key is not valid")
            uid = self.users.id(*found)
            caller = Caller(Peer(pid=0, uid=uid, gid=uid, groups=frozenset()),
                            ("user", found[0]))
            request["caller"] = caller
            return caller
        peer = await self.connections.peer_of(request.transport)
        if peer == "remote":
            raise Forbidden("this listener serves local users only: callers from "
                            "other hosts need an API key (http.api_keys_file)")
        if not isinstance(peer, Peer):
            raise Forbidden("the kernel shows no open socket of this machine at the "
                            "other end of this connection; cannot tell who is asking")
        caller = Caller(peer, ("uid", peer.uid))
        request["caller"] = caller  # a refusal is logged with the uid too
        if not self.policy().allowed(peer):
            log.warning("HTTP: refused uid %d: not allowed", peer.uid)
            raise Forbidden(f"uid {peer.uid} may not use this daemon; ask for "
                            "membership of one of server.allow_groups")
        return caller


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

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        caller = await self._caller(request)
        body = await self.bodies.read_json(request, caller.peer.uid)
        chat = openai.parse_chat(body, _session_header(request),
                                 self.config.low_detail_image_tokens)
        fields = request["fields"]
        if chat.user is not None:
            fields["end_user"] = json.dumps(chat.user)
        await self._fetch_images(chat.remote_images)
        response, request["outcome"] = await self._generate(
            request, chat.params, chat.stream, openai.ChatReplies(chat, self._model_name()),
            caller.peer, fields)
        return response

    async def _fetch_images(self, remote: list[openai.RemoteImage]) -> None:
        if not remote:
            return
        if self.fetcher is None:
            raise openai.bad("messages", "this server does not fetch image URLs "
                             "(http.fetch_image_urls is off); send images as data: URLs")
        for image in remote:
            image.part[image.kind] = await self.fetcher.fetch(
                image.url, _not_an_image if image.kind == "image" else None)

    async def _generate(self, request: web.Request, params: dict[str, Any], stream: bool,
                        replies: Replies, peer: Peer, fields: dict[str, Any]
                        ) -> tuple[web.StreamResponse, str]:
        """Run the generation (protocol v1 ``params``); the response, shaped by the
        dialect's ``replies``, and the outcome to account."""
        rid = next(self._ids)
        exchange = Exchange(self.config.max_unsent_events)
        ctx = RequestContext(request=protocol.Request(rid, "generate", params),
                             peer=peer, connection=exchange)
        exchange.on_overflow = lambda: self._cut_off(request, ctx)
        exchange.in_flight[rid] = ctx
        task = asyncio.ensure_future(self.dispatch(ctx))
        try:
            if stream:
                response = await streaming.stream(
                    request, replies, task, exchange, timeout=self.config.read_timeout_s,
                    send_buffer_bytes=self.send_buffer_bytes,
                    stopped=lambda: self._stopped(request))
            else:
                result = await asyncio.shield(task)
                if result["finish_reason"] == "cancelled":
                    raise self._stopped(request)
                response = web.Response(body=replies.whole(result),
                                        content_type="application/json")
        except asyncio.CancelledError:
            await settle(ctx, task, fields)  # the client left
            raise
        except (asyncio.TimeoutError, ConnectionError) as exc:
            # A stream the client stopped reading (or reset): end it and its generation.
            if isinstance(exc, asyncio.TimeoutError):
                log.warning("HTTP client is not reading its stream (a write waited %g s); "
                            "cutting it off", self.config.read_timeout_s)
            if request.transport is not None:
                request.transport.abort()
            await settle(ctx, task, fields)
            return web.Response(status=499), "cancelled"
        fields.update(ctx.log_fields)
        return response, ctx.outcome or "ok"

    def _cut_off(self, request: web.Request, ctx: RequestContext) -> None:
        log.warning("HTTP client is not reading its stream; cutting it off")
        ctx.cancel()
        if request.transport is not None:
            request.transport.abort()


    async def messages(self, request: web.Request) -> web.StreamResponse:
        """The Anthropic Messages API (``anthropic``), on the same generation path."""
        caller = await self._caller(request)
        body = await self.bodies.read_json(request, caller.peer.uid)
        asked = anthropic.parse_messages(body, _session_header(request))
        fields = request["fields"]
        if asked.user is not None:
            fields["end_user"] = json.dumps(asked.user)
        await self._fetch_images(asked.remote_images)
        engine = self.state.engine
        eos = frozenset(engine.served.eos_token_ids) if engine else frozenset()
        replies = anthropic.MessageReplies(asked, asked.model or self._model_name(), eos)
        response, request["outcome"] = await self._generate(
            request, asked.params, asked.stream, replies, caller.peer, fields)
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """The legacy text completions: a raw prompt, no chat template."""
        caller = await self._caller(request)
        body = await self.bodies.read_json(request, caller.peer.uid)
        asked = openai.parse_completion(body)
        if asked.user is not None:
            request["fields"]["end_user"] = json.dumps(asked.user)
        replies = openai.CompletionReplies(asked, asked.model or self._model_name())
        response, request["outcome"] = await self._generate(
            request, asked.params, asked.stream, replies, caller.peer, request["fields"])
        return response

    # -- the Responses API ------------------------------------------------------------

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API (``responses``), on the same generation path; stored
        responses are each user's own."""
        caller = await self._caller(request)
        uid = caller.peer.uid
        body = await self.bodies.read_json(request, uid)
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is not None and not isinstance(previous, str):
            raise openai.bad("previous_response_id", "previous_response_id must be a string")
        asked = responses.parse_responses(
            body, self.kept_responses.conversation(uid, previous) if previous else None)
        await self._fetch_images(asked.remote_images)

        def kept(response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
            if asked.store:
                self.kept_responses.keep(uid, response, conversation)

        replies = responses.ResponseReplies(asked, asked.model or self._model_name(), kept)
        response, request["outcome"] = await self._generate(
            request, asked.params, asked.stream, replies, caller.peer, request["fields"])
        return response

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """GET or DELETE one of the caller's stored responses."""
        caller = await self._caller(request)
        rid = request.match_info["id"]
        if request.method == "DELETE":
            self.kept_responses.delete(caller.peer.uid, rid)
            return web.json_response({"id": rid, "object": "response.deleted",
                                      "deleted": True})
        return web.json_response(self.kept_responses.get(caller.peer.uid, rid))

    # -- the Ollama API ---------------------------------------------------------------

    async def ollama_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._ollama(request, ollama.parse_chat, "message")

    async def ollama_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._ollama(request, ollama.parse_generate, "response")

    async def _ollama(self, request: web.Request,
                      parse: Callable[[Any, str | None], ollama.OllamaRequest],
                      key: str) -> web.StreamResponse:
        caller = await self._caller(request)
        body = await self.bodies.read_json(request, caller.peer.uid)
        asked = parse(body, _session_header(request))
        replies = ollama.OllamaReplies(asked.model or self._model_name(), key)
        response, request["outcome"] = await self._generate(
            request, asked.params, asked.stream, replies, caller.peer, request["fields"])
        return response

    def _ollama_model(self) -> dict[str, Any]:
        """The served model as Ollama lists it."""
        engine = self.state.require_engine()
        files = [p for p in engine.served.path.rglob("*") if p.is_file()]
        digest = hashlib.sha256(b"".join(
            f"{p.relative_to(engine.served.path)}:{p.stat().st_size}\n".encode()
            for p in sorted(files))).hexdigest()
        modified = max((p.stat().st_mtime for p in files), default=time.time())
        runtime = engine.stats()["runtime"]
        return {"name": engine.served.name, "model": engine.served.name,
                "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(modified)),
                "size": sum(p.stat().st_size for p in files), "digest": digest,
                "details": {"parent_model": "", "format": runtime["name"],
                            "family": "qwen3vl", "families": ["qwen3vl"],
                            "parameter_size": "", "quantization_level":
                            runtime.get("WEIGHTS", "unknown")}}

    async def ollama_tags(self, request: web.Request) -> web.StreamResponse:
        await self._caller(request)
        return web.json_response({"models": [self._ollama_model()]})

    async def ollama_ps(self, request: web.Request) -> web.StreamResponse:
        await self._caller(request)
        entry = self._ollama_model()
        engine = self.state.require_engine()
        return web.json_response({"models": [{
            **entry, "expires_at": "2318-01-01T00:00:00Z",  # loaded while the daemon runs
            "size_vram": 0, "context_length": engine.stats()["max_context_tokens"]}]})

    async def ollama_show(self, request: web.Request) -> web.StreamResponse:
        caller = await self._caller(request)
        body = await self.bodies.read_json(request, caller.peer.uid)
        if not isinstance(body, dict) or not isinstance(body.get("model") or
                                                        body.get("name"), str):
            raise openai.bad("model", "model must be a string")
        engine = self.state.require_engine()
        entry = self._ollama_model()
        context = engine.stats()["max_context_tokens"]
        return web.json_response({
            "modelfile": "", "parameters": "", "template": engine.served.chat_template,
            "details": entry["details"], "modified_at": entry["modified_at"],
            "model_info": {"general.architecture": "qwen3vl",
                           "general.basename": engine.served.name,
                           "qwen3vl.context_length": context},
            "capabilities": ["completion", "vision", "tools"]})

    async def ollama_version(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"version": __version__})

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's ``/v1/messages/count_tokens``: the prompt's tokens, nothing run."""
        caller = await self._caller(request)
        body = await self.bodies.read_json(request, caller.peer.uid)
        asked = anthropic.parse_messages(body, counting=True)
        await self._fetch_images(asked.remote_images)
        ctx = RequestContext(request=protocol.Request(next(self._ids), "count_tokens",
                                                      asked.params),
                             peer=caller.peer, connection=Exchange(1))
        counted = await self.dispatch(ctx)
        return web.json_response({"input_tokens": counted["input_tokens"]})

    def _model_name(self) -> str:
        engine = self.state.engine
        return engine.served.name if engine is not None else "qvld"

    async def models(self, request: web.Request) -> web.StreamResponse:
        await self._caller(request)
        engine = self.state.require_engine()
        entry = {"id": engine.served.name, "object": "model",
                 "created": int(time.time() - (time.monotonic() - self.state.started)),
                 "owned_by": "qvld", "input_modalities": ["text", "image", "video"],
                 "output_modalities": ["text"],
                 # Which runtime computes the answers (the web page shows it).
                 "runtime": f"{engine.served.runtime} {engine.served.runtime_version}",
                 "context_length": engine.stats()["max_context_tokens"],
                 "max_completion_tokens": (self.state.config.engine.max_new_tokens or
                                           engine.stats()["max_context_tokens"]),
                 # The largest body taken (the page checks a picture or clip's size first).
                 "max_request_bytes": self.config.max_body_bytes}
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

    async def web_page(self, request: web.Request) -> web.StreamResponse:
        """The built-in page and its files (``webui``); 404 with http.web_ui off."""
        asset = self._assets.get(request.path) if self.config.web_ui else None
        if asset is None:
            request["outcome"] = "not_found"
            why = "" if self.config.web_ui else " (http.web_ui is off)"
            return _error_response(*openai.error_body(
                code="not_found", message=f"GET {request.path} is not served here{why}"))
        return webui.respond(asset, request)

    async def metrics_text(self, request: web.Request) -> web.StreamResponse:
        await self._caller(request)
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(self.metrics.registry),
                            headers={"Content-Type": content_type})


def _not_an_image(data: bytes) -> str | None:
    return None if openai.image_format(data) is not None else "is not PNG, JPEG, WebP, GIF or BMP"




def _over_tcp(request: web.Request) -> bool:
    """Whether the request came over TCP (not an HTTP Unix socket)."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    return sock is not None and sock.family != socket.AF_UNIX


def _session_header(request: web.Request) -> str | None:
    """X-Qvld-Session (protocol v1's session), checked."""
    session = request.headers.get(SESSION_HEADER)
    if session is not None and not protocol.SESSION_ID.fullmatch(session):
        raise openai.bad(SESSION_HEADER, f"{SESSION_HEADER} must be 1-128 characters of "
                         "[A-Za-z0-9._-]")
    return session


def _error_response(status: int, body: dict[str, Any],
                    headers: Any = None) -> web.Response:
    extra = dict(headers or {})
    if status in (429, 503):
        extra["Retry-After"] = "1"
    if status == 401:
        extra["WWW-Authenticate"] = 'Bearer realm="qvld"'
    return web.json_response(body, status=status, headers=extra)
