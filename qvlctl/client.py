"""A small synchronous client for qvld's Unix socket (protocol v1).

    with Client("/run/qvld/qvld.sock") as client:
        result = client.generate({"messages": [...]}, on_token=print)

Imports only ``qvld.protocol`` and ``qvld.errors``: usable from any program without
the engine's dependencies. Errors from the daemon raise the matching ``QvlError``.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from qvld import protocol
from qvld.errors import QvlError

DEFAULT_SOCKET = "/run/qvld/qvld.sock"
TokenHandler = Callable[[str, list[int]], None]


class ConnectFailed(OSError):
    """No daemon answers on the socket path."""


def default_socket() -> str:
    return os.environ.get("QVLD_SOCKET") or DEFAULT_SOCKET


class Client:
    def __init__(self, path: str | Path | None = None, timeout: float | None = None,
                 max_frame_bytes: int = protocol.DEFAULT_MAX_FRAME_BYTES) -> None:
        self.path = str(path or default_socket())
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)

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
        except OSError:
            sock.close()
            raise
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- frames ---------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        self.connect()
        assert self._sock is not None
        self._sock.sendall(protocol.pack(message))

    def _recv_exactly(self, n: int) -> bytes:
        assert self._sock is not None
        chunks = []
        while n:
            chunk = self._sock.recv(min(n, 1 << 20))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def receive(self) -> dict[str, Any]:
        length = protocol.frame_length(self._recv_exactly(protocol.HEADER.size),
                                       self.max_frame_bytes)
        message = protocol.unpack(self._recv_exactly(length), self.max_frame_bytes)
        if not isinstance(message, dict):
            raise ConnectionError("the daemon sent a frame that is not a map")
        return message

    # -- requests -------------------------------------------------------------------

    def call(self, op: str, params: dict[str, Any] | None = None,
             on_event: Callable[[dict[str, Any]], None] | None = None) -> Any:
        """Send one request and wait for its final reply; events go to ``on_event``."""
        rid = next(self._ids)
        try:
            self.send({"id": rid, "op": op, "params": params or {}})
        except (BrokenPipeError, ConnectionResetError):
            # The daemon closed the line mid-request (e.g. frame_too_large): its last
            # frame says why.
            reply = self.receive()
            raise QvlError.from_wire(reply.get("error") or {}) from None
        while True:
            reply = self.receive()
            if reply.get("id") not in (rid, None):
                continue  # a reply to another request of this connection
            if "event" in reply:
                if on_event is not None:
                    on_event(reply)
                continue
            if reply.get("ok"):
                return reply.get("result")
            raise QvlError.from_wire(reply.get("error") or {})

    def hello(self) -> dict[str, Any]:
        return dict(self.call("hello", {"v": protocol.PROTOCOL_VERSION}))

    def health(self) -> dict[str, Any]:
        return dict(self.call("health"))

    def status(self) -> dict[str, Any]:
        return dict(self.call("status"))

    def config(self) -> dict[str, Any]:
        return dict(self.call("config"))

    def sessions(self, all_users: bool = False) -> list[dict[str, Any]]:
        return list(self.call("sessions", {"action": "list", "all": all_users})["sessions"])

    def close_session(self, sid: str) -> bool:
        return bool(self.call("sessions", {"action": "close", "id": sid})["closed"])

    def reload(self) -> dict[str, Any]:
        return dict(self.call("reload"))

    def generate(self, params: dict[str, Any],
                 on_token: TokenHandler | None = None) -> dict[str, Any]:
        """Run ``generate``; with ``on_token`` the answer streams into it."""
        params = dict(params, stream=on_token is not None)

        def event(message: dict[str, Any]) -> None:
            if on_token is not None and message.get("event") == "token":
                on_token(str(message.get("text", "")), list(message.get("token_ids", [])))

        return dict(self.call("generate", params, on_event=event))
