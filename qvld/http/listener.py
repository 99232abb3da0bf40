"""Where HTTP connections come in: the listening sockets, who the kernel says holds
each connection, and the accept loop that keeps any one user or address to its share
of ``http.max_connections``.

Who holds a connection is asked of the kernel (blocking: on the front's executor, never
on the event loop) once per connection: SO_PEERCRED on an HTTP Unix socket, the socket
table for loopback TCP (``qvld.http.identity``), "remote" for another host.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import socket
import weakref
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from qvld.errors import Busy
from qvld.fairqueue import within_share
from qvld.http import openai
from qvld.http.identity import is_loopback, tcp_peer_uid, user_groups
from qvld.server import Peer, bind_unix

log = logging.getLogger("qvld.http")

UNIX_PREFIX = "unix:"


def connection_owner(sock: socket.socket, peer: Peer | str | None) -> tuple[str, Any]:
    """Whose share of the connections ``sock`` counts against: its local user's, else
    its remote address's."""
    if isinstance(peer, Peer):
        return ("uid", peer.uid)
    address = sock.getpeername()
    return ("address", address[0] if isinstance(address, tuple) else address)


def refuse(conn: socket.socket) -> None:
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


def listen_socket(listen: str, mode: int) -> tuple[socket.socket, Path | None]:
    """The listening socket for http.listen (HOST:PORT, [IPv6]:PORT, :PORT, or
    unix:PATH with ``mode``), and the socket file made for it (removed at close)."""
    if listen.startswith(UNIX_PREFIX):
        path = Path(listen[len(UNIX_PREFIX):])
        return bind_unix(path, mode), path
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
    return sock, None


def kernel_peer(sock: Any) -> Peer | str | None:
    """Who the kernel says is on the other end of an accepted connection (blocking:
    run off the event loop): a Peer, None when no open socket of this machine is that
    end, or the text "remote" for a TCP client on another address than loopback."""
    if sock.family == socket.AF_UNIX:
        return Peer.of(sock)
    peer, local = sock.getpeername(), sock.getsockname()
    if not is_loopback(peer):
        return "remote"
    uid = tcp_peer_uid(peer, local)
    if uid is None:
        return None
    gid, groups = user_groups(uid)
    return Peer(pid=0, uid=uid, gid=gid, groups=groups)


class WireLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's own log: a malformed request is one line, without a traceback (a
    hostile client must not be able to fill the journal with them)."""

    def exception(self, msg: object, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else None
        self.logger.info("malformed HTTP request: %s", error or msg)


class Connections:
    """Each open connection's caller and owner, found once (the kernel's answer holds
    for the connection's life), and the accept loop that judges new ones by them."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        # Each connection's caller (its transport -> a Peer, "remote" or None).
        self.peers: weakref.WeakKeyDictionary[Any, Peer | str | None] = \
            weakref.WeakKeyDictionary()
        # Each connection's owner (its transport -> a uid or a remote address).
        self.owners: weakref.WeakKeyDictionary[Any, tuple[str, Any]] = \
            weakref.WeakKeyDictionary()

    async def accept(self, listener: socket.socket, server: Any,
                     max_connections: Callable[[], int]) -> None:
        """Accept one connection at a time, so that the count of connections is exact
        when the next one is judged (asyncio's own server accepts a whole backlog before
        any of them is counted). At http.max_connections, who holds each connection is
        asked of the kernel (the local user, or the remote address; below the limit
        nobody is asked, so churn costs nothing), and a new one is answered 429 and
        closed only when its owner holds its fair share of them
        (``fairqueue.within_share``): connections opened and never used, by one user or
        address, do not shut out everyone else before anyone is authenticated."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as exc:  # e.g. out of descriptors: let some close first
                log.warning("HTTP: cannot accept a connection: %s", exc)
                await asyncio.sleep(0.1)
                continue
            full = len(server.connections) >= max_connections()
            peer: Peer | str | None = None
            if full:  # whose share would it take? (asked only then: churn costs nothing)
                try:
                    peer = await loop.run_in_executor(self.executor, kernel_peer, conn)
                    owner = connection_owner(conn, peer)
                except OSError:  # gone already
                    conn.close()
                    continue
                # Those accepted below the limit were not asked: asked now, once each.
                await asyncio.gather(*(self.identify(c.transport) for c in server.connections
                                       if c.transport and c.transport not in self.owners))
                held = collections.Counter(self.owners.get(c.transport)
                                           for c in server.connections if c.transport)
                mine = held.pop(owner, 0)
                if not within_share(total=len(server.connections), held=mine,
                                    others=len(held), asked=1,
                                    capacity=max_connections()):
                    refuse(conn)
                    continue
            try:
                transport, _ = await loop.connect_accepted_socket(server, conn)
            except OSError:
                conn.close()
                continue
            if full:
                self.owners[transport] = owner
                self.peers[transport] = peer

    async def identify(self, transport: Any) -> None:
        """Who holds ``transport``'s connection (its share of them), asked of the kernel
        off the event loop; also its caller for its requests."""
        sock = transport.get_extra_info("socket")
        if sock is None or transport.is_closing():
            return
        loop = asyncio.get_running_loop()
        try:
            peer = await loop.run_in_executor(self.executor, kernel_peer, sock)
            self.owners[transport] = connection_owner(sock, peer)
        except OSError:  # gone already
            return
        self.peers.setdefault(transport, peer)

    async def peer_of(self, transport: Any) -> Peer | str | None:
        """Who holds ``transport``'s connection (see the module docstring)."""
        if transport is None:
            return None
        try:
            return self.peers[transport]
        except KeyError:
            pass
        sock = transport.get_extra_info("socket")
        loop = asyncio.get_running_loop()
        try:
            peer = await loop.run_in_executor(self.executor, kernel_peer, sock)
        except OSError as exc:  # the connection is already gone
            log.info("HTTP: cannot identify a caller: %s", exc)
            peer = None
        self.peers[transport] = peer
        return peer
