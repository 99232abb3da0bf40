"""asyncio Unix-socket server: peer credentials, frames -> handlers -> frames.

One task reads a connection's frames; every request runs in its own task, so several
may be in flight on one connection and ``health`` never waits behind a generation.
Replies are written whole (one ``write`` per frame) from the event loop thread only;
worker threads hand their frames over with ``call_soon_threadsafe``. Any unexpected
exception becomes ``internal`` at one boundary (``_run``), logged with the request id.

What a client can make the daemon hold is bounded: connections (``max_connections``,
refused ones included), idle connections (closed after ``idle_timeout_s``), the bytes
of frames still arriving (``max_pending_bytes`` in all, ``max_frame_bytes`` per uid),
requests in flight per connection, and what a frame decodes to (``protocol.unpack``).
A refused peer's frames are never decoded beyond a few bytes.
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
from typing import Any, Protocol

from qvld import protocol
from qvld.config import ServerConfig
from qvld.errors import BadRequest, Busy, Forbidden, FrameTooLarge, InternalError, QvlError
from qvld.logfields import log_request

log = logging.getLogger("qvld.server")


class SocketInUse(RuntimeError):
    """Another live daemon answers on the socket path."""


def bind_unix(path: Path, mode: int) -> socket.socket:
    """A listening Unix socket at ``path`` with ``mode``, never wider for a moment;
    a stale socket file there is replaced, a live one (another daemon) is not."""
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
    os.chmod(path, mode)
    sock.listen(socket.SOMAXCONN)  # bursts queue here; max_connections is enforced on accept
    return sock


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    @classmethod
    def of(cls, sock: socket.socket) -> Peer:
        """The peer as the kernel recorded it when it connected: uid, gid and pid from
        SO_PEERCRED, supplementary groups from SO_PEERGROUPS. Never from /proc/PID read
        later: by then the pid may name another process (pid reuse), and an unallowed
        uid borrowed an allowed one's groups that way."""
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", creds)
        groups = _peer_groups(sock)
        if groups is None:
            groups = _user_groups(uid, gid)
        return cls(pid, uid, gid, frozenset({gid}) | groups)


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python names it 3.13+
_GROUPS_BUFFER = 1024  # the most Python's getsockopt reads: 256 groups


def _peer_groups(sock: socket.socket) -> frozenset[int] | None:
    """The peer's supplementary groups as of its connect() (SO_PEERGROUPS); None when the
    kernel does not say (an older kernel, or more than 256 groups)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_BUFFER)
    except OSError:
        return None
    count = len(raw) // 4
    return frozenset(struct.unpack(f"{count}I", raw[:count * 4]))


def _user_groups(uid: int, gid: int) -> frozenset[int]:
    """The groups the user database gives ``uid`` (when the kernel does not say)."""
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


class Channel(Protocol):
    """Where a request's events go and what else is in flight beside it: a socket
    connection, or one HTTP exchange."""

    in_flight: dict[int, RequestContext]

    def send_threadsafe(self, message: dict[str, Any]) -> None: ...


@dataclass
class RequestContext:
    """What a handler may use besides its params."""

    request: protocol.Request
    peer: Peer
    connection: Channel
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_cancel: list[Callable[[], None]] = field(default_factory=list)
    arrived: float = field(default_factory=time.monotonic)
    # What the request log line says besides op, outcome and duration.
    log_fields: dict[str, Any] = field(default_factory=dict)
    # Set by a handler whose successful reply is not plainly "ok" (e.g. "cancelled").
    outcome: str | None = None

    def cancel(self) -> None:
        self.cancelled.set()
        for callback in self.on_cancel:
            callback()

    def send_event(self, message: dict[str, Any]) -> None:
        """Thread-safe: queue a frame for this request's connection."""
        self.connection.send_threadsafe(message)


Handler = Callable[[RequestContext], Awaitable[Any]]


class PendingBytes:
    """Bytes of frames announced but not yet received, in all and per uid.

    A frame is received into memory whole; without this bound every connection could
    park a max-size half-frame (256 x 32 MiB). A user holding nothing may also take from
    a headroom past ``total`` (an eighth of it), so that others filling the bound never
    refuse a user who holds none of it."""

    def __init__(self, total: int, per_uid: int) -> None:
        self.total = total
        self.per_uid = per_uid
        self.held = 0
        self._by_uid: dict[int, int] = {}

    def reserve(self, uid: int, n: int) -> bool:
        mine = self._by_uid.get(uid, 0)
        room = self.total + (self.total // 8 if not mine else 0)
        if self.held + n > room or mine + n > self.per_uid:
            return False
        self.held += n
        self._by_uid[uid] = mine + n
        return True

    def release(self, uid: int, n: int) -> None:
        self.held -= n
        left = self._by_uid.get(uid, 0) - n
        if left > 0:
            self._by_uid[uid] = left
        else:
            self._by_uid.pop(uid, None)


# A refused peer is answered with the id of its first request when that frame is tiny;
# anything larger is not read at all.
REFUSED_PEEK_BYTES = 1024


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
                 on_reply: Callable[[object, str, float, int], None] | None = None) -> None:
        self.config = config
        self.on_reply = on_reply
        self.dispatch = dispatch
        self.policy = policy or AccessPolicy(config)
        self.connections: set[Connection] = set()
        self.refusing = 0  # connections being told busy/forbidden (count towards the limit)
        self.pending = PendingBytes(config.max_pending_bytes, config.max_frame_bytes)
        self._server: asyncio.AbstractServer | None = None
        self._owned_path: Path | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def reconfigure(self, config: ServerConfig) -> None:
        """New limits and access lists (a reload); the socket itself stays."""
        self.config = config
        self.policy = AccessPolicy(config)
        self.pending.total = config.max_pending_bytes
        self.pending.per_uid = config.max_frame_bytes

    # -- socket ---------------------------------------------------------------------

    def bind(self) -> socket.socket:
        """Create the listening socket at config.socket; replace a stale one only."""
        sock = bind_unix(self.config.socket, self.config.socket_mode_bits)
        self._owned_path = self.config.socket
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
            if len(self.connections) + self.refusing >= self.config.max_connections:
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
            self.on_reply(op, outcome, seconds, conn.peer.uid)
        if op == "health" and outcome == "ok":
            return  # health checks would drown the journal
        log_request("request %d/%s uid=%d op=%s outcome=%s time=%.3fs", (
            conn.number, "-" if rid is None else rid, conn.peer.uid, protocol.op_label(op),
            outcome, seconds), {
            "api": "socket", "connection": conn.number, "request": rid,
            "uid": conn.peer.uid, "op": protocol.op_label(op), "outcome": outcome,
            "time_s": round(seconds, 6), **fields})

    async def _refuse(self, conn: Connection, exc: QvlError) -> None:
        """Answer the first request (so the client reads why) and nothing more.

        Only a tiny first frame is read, to echo its id; past ``max_connections``
        refusals in progress, not even that.
        """
        rid = None
        if self.refusing < self.config.max_connections:
            self.refusing += 1
            try:
                rid = await asyncio.wait_for(self._peek_request_id(conn),
                                             min(self.config.read_timeout_s, 5.0))
            except (QvlError, asyncio.TimeoutError, asyncio.IncompleteReadError):
                pass
            finally:
                self.refusing -= 1
        conn.send(protocol.error(rid, exc))

    @staticmethod
    async def _peek_request_id(conn: Connection) -> int | None:
        header = await conn.reader.readexactly(protocol.HEADER.size)
        (length,) = protocol.HEADER.unpack(header)
        if length > REFUSED_PEEK_BYTES:
            return None
        payload = await conn.reader.readexactly(length)
        return protocol.request_id(protocol.unpack(payload, REFUSED_PEEK_BYTES, max_objects=64))

    async def _wait_for_frame(self, conn: Connection) -> bytes | None:
        """The first byte of the next frame; None when the line closes or stays idle
        (nothing in flight) for ``idle_timeout_s``."""
        while True:
            try:
                return await asyncio.wait_for(conn.reader.readexactly(1),
                                              self.config.idle_timeout_s)
            except asyncio.IncompleteReadError:
                return None
            except asyncio.TimeoutError:
                if conn.in_flight:
                    continue  # waiting for its own replies is not idle
                log.info("connection %d (uid %d): idle for %.0f s; closing", conn.number,
                         conn.peer.uid, self.config.idle_timeout_s)
                return None

    async def _read_frame(self, conn: Connection) -> bytes | None:
        """The next frame's payload; None when the line closes, idles or stalls.

        Raises ``frame_too_large``, or ``busy`` when the bytes it announces do not fit
        what the daemon holds of incomplete frames (the line cannot be read further).
        """
        first = await self._wait_for_frame(conn)
        if first is None:
            return None
        timeout = self.config.read_timeout_s
        try:
            header = first + await asyncio.wait_for(
                conn.reader.readexactly(protocol.HEADER.size - 1), timeout)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            log.info("connection %d: closed or stalled inside a frame header", conn.number)
            return None
        length = protocol.frame_length(header, self.config.max_frame_bytes)
        uid = conn.peer.uid
        if not self.pending.reserve(uid, length):
            raise Busy(f"the daemon is receiving too much at once ({length} more bytes "
                       "do not fit server.max_pending_bytes or this user's share); retry")
        try:
            return await asyncio.wait_for(conn.reader.readexactly(length), timeout)
        except asyncio.TimeoutError:
            log.info("connection %d: frame not completed within %.0f s", conn.number,
                     timeout)
            return None
        except asyncio.IncompleteReadError:
            return None
        finally:
            self.pending.release(uid, length)

    async def _read_loop(self, conn: Connection) -> None:
        while True:
            try:
                payload = await self._read_frame(conn)
            except (FrameTooLarge, Busy) as exc:
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
            del payload  # the frame's bytes are not kept beside what they decoded to
            rid = protocol.request_id(message)
            try:
                request = protocol.parse_request(message)
                if request.id in conn.in_flight:
                    raise BadRequest(f"request id {request.id} is already in flight")
                if len(conn.in_flight) >= self.config.max_requests_per_connection:
                    raise Busy(f"this connection has {len(conn.in_flight)} requests in "
                               "flight (server.max_requests_per_connection); retry")
            except QvlError as exc:
                op = message.get("op") if isinstance(message, dict) else None
                self._account(conn, rid, op, exc.code, t0, {})
                conn.send(protocol.error(rid, exc))
                continue
            ctx = RequestContext(request=request, peer=conn.peer, connection=conn)
            conn.in_flight[request.id] = ctx
            task = asyncio.create_task(self._run(conn, ctx))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, conn: Connection, ctx: RequestContext) -> None:
        rid = ctx.request.id
        outcome = "ok"
        try:
            result = await self.dispatch(ctx)
            reply = protocol.ok(rid, result)
            outcome = ctx.outcome or "ok"
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
