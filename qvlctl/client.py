"""A small synchronous client for qvld's Unix socket (protocol v1).

    with Client("/run/qvld/qvld.sock") as client:
        result = client.generate({"messages": [...]}, on_token=print)

Imports only ``qvld.protocol``, ``qvld.errors`` and ``qvlctl.replies``: usable from any
program without the engine's dependencies. Errors from the daemon raise the matching ``QvlError``;
replies that break the protocol raise ``MalformedReply`` (see ``qvlctl.replies``); a
socket this user may not open raises ``AccessDenied`` with what to do about it.
"""

from __future__ import annotations

import collections
import grp
import itertools
import os
import select
import socket
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from qvlctl import replies
from qvlctl.replies import MalformedReply
from qvld import protocol
from qvld.errors import QvlError

__all__ = ["DEFAULT_SOCKET", "AccessDenied", "Client", "ConnectFailed", "MalformedReply",
           "default_socket"]

DEFAULT_SOCKET = "/run/qvld/qvld.sock"
TokenHandler = Callable[[str, list[int]], None]


class ConnectFailed(OSError):
    """No daemon answers on the socket path."""


class AccessDenied(OSError):
    """The socket (or its directory) does not let this user in; ``strerror`` says why."""


def default_socket() -> str:
    # An empty QVLD_SOCKET is treated as unset, as shells leave `QVLD_SOCKET=` around.
    return os.environ.get("QVLD_SOCKET") or DEFAULT_SOCKET


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:  # a gid without a name: usermod takes the number as well
        return str(gid)


def access_hint(path: str) -> str:
    """Why ``path`` refused this user, and the usual remedy (the group that owns it)."""
    for candidate in (path, os.path.dirname(path) or "."):
        try:
            st = os.stat(candidate)
        except OSError:
            continue  # a directory we may not search hides the socket: ask its parent
        if candidate == path and not st.st_mode & 0o020:
            # Joining the group would not help: only the owner may write (connect).
            return (f"permission denied on {path}: its mode {st.st_mode & 0o777:04o} lets "
                    f"only its owner connect; ask an administrator for access "
                    f"(server.socket_mode, server.allow_groups)")
        group = _group_name(st.st_gid)
        break
    else:
        group = "qvl"  # what the packages create for clients
    return (f"permission denied on {path}: join the group that owns it "
            f"(e.g. `sudo usermod -aG {group} $USER`, then log in again)")


class Client:
    def __init__(self, path: str | Path | None = None, timeout: float | None = None,
                 max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES) -> None:
        # Only None means "the default": an empty path is a caller's mistake, not a wish
        # for /run/qvld/qvld.sock.
        self.path = default_socket() if path is None else str(path)
        if not self.path:
            raise ValueError("the socket path is empty")
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        # Replies are read in chunks and cut into frames by the protocol's own reader.
        self._buffer = protocol.FrameBuffer(max_frame_bytes)
        self._frames: collections.deque[bytes] = collections.deque()

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def connect(self) -> None:
        if self._sock is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise ConnectFailed(exc.errno, f"no daemon answers on {self.path} "
                                           f"({exc.strerror})") from exc
        except PermissionError as exc:  # EACCES/EPERM: the daemon may well be running
            sock.close()
            raise AccessDenied(exc.errno, access_hint(self.path)) from exc
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buffer = protocol.FrameBuffer(self.max_frame_bytes)
        self._frames.clear()

    def _reconnect_if_closed(self) -> None:
        """Between requests, a line the daemon closed (it closes idle connections after
        server.idle_timeout_s, e.g. while a chat user thinks) is opened again, so a
        long-lived client never sees the idle timeout."""
        sock = self._sock
        if sock is None or self._frames or self._buffer.pending or not _readable(sock):
            return  # nothing to read (or a reply still to take): still open
        try:
            closed = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (ConnectionResetError, BlockingIOError):
            closed = True
        if closed:
            self.close()
            self.connect()

    # -- frames ---------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        self.connect()
        assert self._sock is not None
        self._sock.sendall(protocol.pack(message))

    def receive(self) -> dict[str, Any]:
        """The next reply map (``MalformedReply`` if the frame is not one)."""
        assert self._sock is not None
        while not self._frames:
            chunk = self._sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            try:
                self._frames.extend(self._buffer.feed(chunk))
            except QvlError as exc:  # frame_too_large: the daemon's frame, not the request
                raise MalformedReply(exc.message) from None
        return replies.decode(self._frames.popleft(), self.max_frame_bytes)

    # -- requests -------------------------------------------------------------------

    def call(self, op: str, params: dict[str, Any] | None = None,
             on_event: Callable[[dict[str, Any]], None] | None = None) -> Any:
        """Send one request and wait for its final reply; events go to ``on_event``."""
        rid = next(self._ids)
        self._reconnect_if_closed()
        try:
            self.send({"id": rid, "op": op, "params": params or {}})
        except (BrokenPipeError, ConnectionResetError):
            # The daemon closed the line mid-request (e.g. frame_too_large): its last
            # frame says why.
            return replies.result(self.receive())
        while True:
            reply = self.receive()
            if replies.reply_id(reply) not in (rid, None):
                continue  # a reply to another request of this connection
            if "event" in reply:
                if on_event is not None:
                    on_event(reply)
                continue
            return replies.result(reply)

    # Each op's result is checked here, once, so callers index it without guarding.

    def hello(self) -> dict[str, Any]:
        return replies.as_map(self.call("hello", {"v": protocol.PROTOCOL_VERSION}),
                              "the hello result")

    def health(self) -> dict[str, Any]:
        return replies.health(self.call("health"))

    def status(self) -> dict[str, Any]:
        return replies.as_map(self.call("status"), "the status result")

    def config(self) -> dict[str, Any]:
        return replies.as_map(self.call("config"), "the config result")

    def sessions(self, all_users: bool = False) -> list[dict[str, Any]]:
        return replies.sessions(self.call("sessions", {"action": "list", "all": all_users}))

    def close_session(self, sid: str) -> bool:
        return replies.closed(self.call("sessions", {"action": "close", "id": sid}))

    def reload(self) -> dict[str, Any]:
        return replies.reload(self.call("reload"))

    def drain(self, action: str = "start") -> dict[str, Any]:
        """``start`` (take no new generations), ``stop`` (take them again), ``status``."""
        return replies.drain(self.call("drain", {"action": action}))

    def preflight(self) -> dict[str, Any]:
        return replies.preflight(self.call("preflight"))

    def metrics(self) -> str:
        return replies.metrics_text(self.call("metrics"))

    def generate(self, params: dict[str, Any],
                 on_token: TokenHandler | None = None) -> dict[str, Any]:
        """Run ``generate``; with ``on_token`` the answer streams into it."""
        params = dict(params, stream=on_token is not None)

        def event(message: dict[str, Any]) -> None:
            piece = replies.token(message)
            if on_token is not None and piece is not None:
                on_token(*piece)

        return replies.generated(self.call("generate", params, on_event=event))


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read (or was closed), without waiting. poll, not
    select: select() fails on descriptors past 1023, which a busy application has."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
