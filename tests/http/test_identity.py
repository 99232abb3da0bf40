"""The kernel's answer to "who owns the other end of this connection" (qvld.http.identity),
on real sockets: connections made by other uids, over IPv4, IPv6 and IPv4 into an IPv6
listener, through sock_diag and through /proc/net/tcp, and a client that closed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from qvld.http import identity
from qvld.http.identity import is_loopback, tcp_peer_uid, user_groups
from tests.conftest import NOBODY

# Connects to argv[1]:argv[2], says so, and holds the connection until stdin closes.
HOLDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
print("connected", flush=True)
sys.stdin.read()
"""


@pytest.fixture(params=["sock_diag", "proc"])
def lookup(request: pytest.FixtureRequest,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., int | None]]:
    """tcp_peer_uid through netlink, or forced onto the /proc fallback."""
    if request.param == "proc":
        def refuse(*args: Any) -> None:
            raise PermissionError(1, "Operation not permitted")
        monkeypatch.setattr(identity, "_netlink_owner", refuse)
        monkeypatch.setattr(identity, "_netlink_refused", False)
    yield tcp_peer_uid
    if request.param == "proc":
        assert identity._netlink_refused  # it did fall back


def held_connection(server: socket.socket, host: str, uid: int
                    ) -> tuple[subprocess.Popen[str], socket.socket, Any]:
    python = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
    proc = subprocess.Popen([python, "-c", HOLDER, host, str(server.getsockname()[1])],
                            user=uid, group=uid, extra_groups=[], cwd="/",
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin"})
    assert proc.stdout is not None and proc.stdout.readline() == "connected\n"
    conn, peer = server.accept()
    return proc, conn, peer


@pytest.mark.parametrize("uid", [0, NOBODY])
def test_the_uid_of_a_process_on_the_other_end(lookup: Callable[..., int | None],
                                               uid: int) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        proc, conn, peer = held_connection(server, "127.0.0.1", uid)
        with conn:
            assert lookup(peer, conn.getsockname()) == uid
            proc.communicate("")  # the client closes its end
            assert lookup(peer, conn.getsockname()) is None


def test_ipv6_and_ipv4_into_an_ipv6_listener(lookup: Callable[..., int | None]) -> None:
    with socket.create_server(("::", 0), family=socket.AF_INET6,
                              dualstack_ipv6=True) as server:
        for host in ("::1", "127.0.0.1"):
            proc, conn, peer = held_connection(server, host, NOBODY)
            with conn:
                if host == "127.0.0.1":
                    assert peer[0] == "::ffff:127.0.0.1"
                assert lookup(peer, conn.getsockname()) == NOBODY
            proc.communicate("")


def test_a_client_that_closed_is_nobody_not_root(lookup: Callable[..., int | None]) -> None:
    """The kernel keeps a closed client's end a while, owned by no process, and shows it
    as uid 0: such a connection must never pass for root's."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        proc, conn, peer = held_connection(server, "127.0.0.1", NOBODY)
        with conn:
            proc.communicate("")
            assert lookup(peer, conn.getsockname()) is None
            # A connection the kernel has never seen.
            assert lookup(("127.0.0.1", 1), conn.getsockname()) is None


def test_loopback_and_user_groups() -> None:
    assert is_loopback(("127.0.0.5", 1)) and is_loopback(("::1", 1, 0, 0))
    assert is_loopback(("::ffff:127.0.0.1", 1, 0, 0))
    assert not is_loopback(("10.0.0.1", 1)) and not is_loopback(None)
    assert not is_loopback(("not an address", 1))
    gid, groups = user_groups(0)
    assert gid == 0 and 0 in groups
    assert user_groups(65533) == (65533, frozenset())  # no passwd entry
    assert user_groups(os.getuid())[0] == os.getgid()


def test_a_listening_socket_is_nobodys_connection(lookup: Callable[..., int | None]) -> None:
    """#46: with no connection matching, the kernel's lookup can answer with a socket
    listening on the asked client address and port; its owner (root here) is not a
    caller. Only a connection with exactly the four addresses asked for counts."""
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_server(("127.0.0.1", 0)) as listener:
        claimed = ("127.0.0.1", listener.getsockname()[1])  # no connection from here
        assert lookup(claimed, server.getsockname()) is None
