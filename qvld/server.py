"""asyncio Unix-socket server: peer credentials, frames -> handlers -> frames.

One task reads a connection's frames; every request runs in its own task, so several
may be in flight on one connection and ``health`` never waits behind a generation.
Replies are written whole (one ``write`` per frame) from the event loop thread only;
worker threads hand their frames over with ``call_soon_threadsafe``. Any unexpected
exception becomes ``internal`` at one boundary (``_run``), logged with the request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import itertools
import logging
import os
import pwd
import socket
import stat
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qvld import protocol
from qvld.config import ServerConfig
from qvld.errors import BadRequest, Busy, Forbidden, FrameTooLarge, InternalError, QvlError

log = logging.getLogger("qvld.server")


class SocketInUse(RuntimeError):
    """Another live daemon answers on the socket path."""


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    @classmethod
    def of(cls, sock: socket.socket) -> Peer:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        groups = _process_groups(pid)
        if groups is None:
            groups = _user_groups(uid, gid)
        return cls(pid, uid, gid, frozenset({gid}) | groups)


def _process_groups(pid: int) -> frozenset[int] | None:
    """Supplementary groups of the peer process, from /proc (authoritative); None when
    /proc does not show other users' processes (ProtectProc=invisible in the unit)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return None


def _user_groups(uid: int, gid: int) -> frozenset[int]:
    """The groups the user database gives ``uid`` (the fallback to /proc)."""
    try:
        return frozenset(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OSError):
        return frozenset()


class AccessPolicy:
    """Who may use the socket: root, the daemon's uid, allow_uids, allow_groups members."""

    def __init__(self, config: ServerConfig, own_uid: int | None = None) -> None:
        self.own_uid = os.getuid() if own_uid is None else own_uid
        self.allow_uids = frozenset(config.allow_uids)
        self.allow_gids = self._gids(config.allow_groups)
        self.admin_gids = self._gids(config.admin_groups)

    @staticmethod
    def _gids(names: list[str]) -> frozenset[int]:
        gids = set()
        for name in names:
            try:
                gids.add(grp.getgrnam(name).gr_gid)
            except KeyError:
                log.warning("group %r does not exist; it grants nothing", name)
        return frozenset(gids)

    def allowed(self, peer: Peer) -> bool:
        return (peer.uid in (0, self.own_uid) or peer.uid in self.allow_uids
                or bool(peer.groups & self.allow_gids))

    def is_admin(self, peer: Peer) -> bool:
        return peer.uid in (0, self.own_uid) or bool(peer.groups & self.admin_gids)


@dataclass
class RequestContext:
    """What a handler may use besides its params."""

    request: protocol.Request
    peer: Peer
    connection: Connection
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_cancel: list[Callable[[], None]] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)
    # What the request log line says besides op, outcome and duration.
    log_fields: dict[str, Any] = field(default_factory=dict)

    def cancel(self) -> None:
        self.cancelled.set()
        for callback in self.on_cancel:
            callback()

    def send_event(self, message: dict[str, Any]) -> None:
        """Thread-safe: queue a frame for this request's connection."""
        self.connection.send_threadsafe(message)


Handler = Callable[[RequestContext], Awaitable[Any]]


class Connection:
    ids = itertools.count(1)

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 peer: Peer, send_buffer_bytes: int = 1 << 20) -> None:
        self.number = next(self.ids)
        self.send_buffer_bytes = send_buffer_bytes
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self.in_flight: dict[int, RequestContext] = {}
        self.closed = False

    def send(self, message: dict[str, Any]) -> None:
        if self.closed or self.writer.is_closing():
            return
        self.writer.write(protocol.pack(message))
        if self.writer.transport.get_write_buffer_size() > self.send_buffer_bytes:
            # Never let one client's unread stream grow without bound or stall others.
            log.warning("connection %d (uid %d): client is not reading; cutting it off",
                        self.number, self.peer.uid)
            self.closed = True
            self.cancel_all()
            self.writer.transport.abort()

    def send_threadsafe(self, message: dict[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.send, message)

    def cancel_all(self) -> None:
        for ctx in list(self.in_flight.values()):
            ctx.cancel()


class Server:
    def __init__(self, config: ServerConfig, dispatch: Callable[[RequestContext], Awaitable[Any]],
                 policy: AccessPolicy | None = None,
                 on_reply: Callable[[object, str, float], None] | None = None) -> None:
        self.config = config
        self.on_reply = on_reply
        self.dispatch = dispatch
        self.policy = policy or AccessPolicy(config)
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._owned_path: Path | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- socket ---------------------------------------------------------------------

    def bind(self) -> socket.socket:
        """Create the listening socket at config.socket; replace a stale one only."""
        path = self.config.socket
        path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(path):
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise SocketInUse(f"{path} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                log.info("removing stale socket %s", path)
                path.unlink(missing_ok=True)
            else:
                raise SocketInUse(f"another daemon is listening on {path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)  # no window in which the socket is wider than asked
        try:
            sock.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, self.config.socket_mode_bits)
        sock.listen(socket.SOMAXCONN)  # bursts queue here; max_connections is enforced on accept
        self._owned_path = path
        return sock

    async def start(self, sock: socket.socket | None = None) -> None:
        """Serve on ``sock`` (e.g. from systemd) or on a socket bound here."""
        if sock is None:
            sock = self.bind()
        sock.setblocking(False)
        self._server = await asyncio.start_unix_server(
            self._accept, sock=sock, limit=2 ** 16, backlog=socket.SOMAXCONN)

    @property
    def address(self) -> str:
        assert isinstance(self._server, asyncio.Server)
        return str(self._server.sockets[0].getsockname())

    async def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._owned_path is not None:
            self._owned_path.unlink(missing_ok=True)
            self._owned_path = None

    async def close(self) -> None:
        await self.stop_accepting()
        for conn in list(self.connections):
            conn.cancel_all()
            conn.writer.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    # -- connections ----------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        peer = Peer.of(sock)
        # The kernel's share of the send buffer is bounded too (see Connection.send).
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.send_buffer_bytes)
        conn = Connection(reader, writer, peer, self.config.send_buffer_bytes)
        try:
            if len(self.connections) >= self.config.max_connections:
                await self._refuse(conn, Busy("too many connections; retry later"))
                return
            if not self.policy.allowed(peer):
                log.warning("refused uid %d (pid %d): not allowed", peer.uid, peer.pid)
                await self._refuse(conn, Forbidden(
                    f"uid {peer.uid} may not use this daemon; ask for membership of "
                    "one of server.allow_groups"))
                return
            self.connections.add(conn)
            await self._read_loop(conn)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client left, or the server is closing: nothing to report
        finally:
            self.connections.discard(conn)
            conn.closed = True
            conn.cancel_all()
            with contextlib.suppress(Exception):
                if writer.can_write_eof():
                    await writer.drain()
                writer.close()

    def _account(self, conn: Connection, rid: int | None, op: object, outcome: str,
                 t0: float, fields: dict[str, Any]) -> None:
        """One log line and the metrics for every request, whatever became of it."""
        seconds = time.monotonic() - t0
        if self.on_reply is not None:
            self.on_reply(op, outcome, seconds)
        if op == "health" and outcome == "ok":
            return  # health checks would drown the journal
        extra = "".join(f" {key}={value}" for key, value in fields.items())
        log.log(logging.INFO if outcome in ("ok", "cancelled") else logging.WARNING,
                "request %d/%s uid=%d op=%s outcome=%s time=%.3fs%s", conn.number,
                "-" if rid is None else rid, conn.peer.uid,
                op if isinstance(op, str) and op in protocol.OPS else "unknown",
                outcome, seconds, extra)

    async def _refuse(self, conn: Connection, exc: QvlError) -> None:
        """Answer the first request (so the client reads why) and nothing more."""
        rid = None
        try:
            payload = await asyncio.wait_for(self._read_frame(conn),
                                             min(self.config.read_timeout_s, 5.0))
            if payload is not None:
                rid = protocol.request_id(protocol.unpack(payload, self.config.max_frame_bytes))
        except (QvlError, asyncio.TimeoutError):
            pass
        conn.send(protocol.error(rid, exc))

    async def _read_frame(self, conn: Connection) -> bytes | None:
        try:
            header = await conn.reader.readexactly(protocol.HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                log.info("connection %d: closed inside a frame header", conn.number)
            return None
        length = protocol.frame_length(header, self.config.max_frame_bytes)
        try:
            return await asyncio.wait_for(conn.reader.readexactly(length),
                                          self.config.read_timeout_s)
        except asyncio.TimeoutError:
            log.info("connection %d: frame not completed within %.0f s", conn.number,
                     self.config.read_timeout_s)
            return None

    async def _read_loop(self, conn: Connection) -> None:
        while True:
            try:
                payload = await self._read_frame(conn)
            except FrameTooLarge as exc:
                conn.send(protocol.error(None, exc))
                return
            if payload is None:
                return
            t0 = time.monotonic()
            try:
                message = protocol.unpack(payload, self.config.max_frame_bytes)
            except QvlError as exc:
                # Count before replying: a client may scrape the metrics right after.
                self._account(conn, None, None, exc.code, t0, {})
                conn.send(protocol.error(None, exc))
                continue
            rid = protocol.request_id(message)
            try:
                request = protocol.parse_request(message)
                if request.id in conn.in_flight:
                    raise BadRequest(f"request id {request.id} is already in flight")
            except QvlError as exc:
                op = message.get("op") if isinstance(message, dict) else None
                self._account(conn, rid, op, exc.code, t0, {})
                conn.send(protocol.error(rid, exc))
                continue
            ctx = RequestContext(request=request, peer=conn.peer, connection=conn)
            conn.in_flight[request.id] = ctx
            task = asyncio.create_task(self._run(ctx))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, ctx: RequestContext) -> None:
        rid = ctx.request.id
        conn = ctx.connection
        outcome = "ok"
        try:
            result = await self.dispatch(ctx)
            reply = protocol.ok(rid, result)
            if isinstance(result, dict) and result.get("finish_reason") == "cancelled":
                outcome = "cancelled"
        except QvlError as exc:
            reply = protocol.error(rid, exc)
            outcome = exc.code
        except Exception:
            log.exception("internal error in request %d/%d (op %s)", conn.number, rid,
                          ctx.request.op)
            reply = protocol.error(rid, InternalError(
                f"internal error (logged as request {conn.number}/{rid})"))
            outcome = "internal"
        finally:
            conn.in_flight.pop(rid, None)
        self._account(conn, rid, ctx.request.op, outcome, ctx.arrived, ctx.log_fields)
        try:
            conn.send(reply)
        except (TypeError, ValueError):
            log.exception("reply to %d/%d cannot be packed", conn.number, rid)
            conn.send(protocol.error(rid, InternalError("the reply could not be encoded")))
