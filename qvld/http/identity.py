"""Who is on the other end of an HTTP connection, as the kernel knows it.

Without a keys file the HTTP front identifies a caller the way the protocol socket does,
by the kernel's word rather than anything the client sends:

- **loopback TCP**: the uid that owns the client's end of the connection, found in the
  kernel's TCP socket table by the connection's address pair (the client's address and
  port, ours), as identd answers. The lookup is sock_diag's exact one (``NETLINK_SOCK_DIAG``,
  what ``ss`` uses: one socket, no table scan); where netlink is not allowed (a unit's
  ``RestrictAddressFamilies=`` without ``AF_NETLINK``, some containers) the same row is
  read from ``/proc/net/tcp`` or ``tcp6``.
- **a Unix socket** (``http.listen: unix:PATH``, or one passed by systemd): SO_PEERCRED,
  as on the protocol socket (``qvld.server.Peer.of``).

A socket's owner is the effective uid that created it; it cannot be changed after. Only
an end still held open by a process counts: once a client closes its socket the kernel
keeps the connection a while as a socket of no process (inode 0), and reports its owner
as uid 0. Such a connection is nobody's (``None``), never root's: a client that sends a
request and closes at once must not be served as root.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import pwd
import socket
import struct
from typing import Any

log = logging.getLogger("qvld.http")

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 0x2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
TCP_LISTEN = 10
_NLMSGHDR = struct.Struct("=IHHII")
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid: ports
# (network order), source and destination (16 bytes each), interface, cookie.
_REQUEST = struct.Struct("=BBBBI")
_SOCKID = struct.Struct(">HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
# inet_diag_msg after the header: family, state, timer, retrans, the sockid (48 bytes),
# expires, rqueue, wqueue, uid, inode.
_MSG_HEAD = struct.Struct("=BBBB")
_MSG_TAIL = struct.Struct("=IIIII")
_MSG_TAIL_OFFSET = _NLMSGHDR.size + _MSG_HEAD.size + 48

Address = tuple[Any, ...]  # what getpeername()/getsockname() return for TCP

_netlink_refused = False  # set once netlink is refused: /proc from then on


def _family_and_addresses(peer: Address, local: Address) -> tuple[int, bytes, bytes]:
    """The address family the kernel hashes the connection under, and both addresses
    packed. A client of an IPv6 listener that connected over IPv4 shows as
    ``::ffff:a.b.c.d``; its own socket is an IPv4 one."""
    peer_ip = ipaddress.ip_address(str(peer[0]).split("%")[0])
    local_ip = ipaddress.ip_address(str(local[0]).split("%")[0])
    if isinstance(peer_ip, ipaddress.IPv6Address) and peer_ip.ipv4_mapped is not None:
        peer_ip = peer_ip.ipv4_mapped
    if isinstance(local_ip, ipaddress.IPv6Address) and local_ip.ipv4_mapped is not None:
        local_ip = local_ip.ipv4_mapped
    family = socket.AF_INET if peer_ip.version == 4 else socket.AF_INET6
    return family, peer_ip.packed, local_ip.packed


def _netlink_owner(family: int, peer: bytes, peer_port: int, local: bytes,
                   local_port: int) -> tuple[int, int] | None:
    """(uid, inode) of the client's socket, by sock_diag's exact lookup; None if the
    kernel has no such socket. OSError when netlink cannot be used."""
    sockid = (_SOCKID.pack(peer_port, local_port, peer.ljust(16, b"\0"),
                           local.ljust(16, b"\0"))
              + _SOCKID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    request = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(request), SOCK_DIAG_BY_FAMILY,
                            NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC,
                       NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.send(header + request)
        reply = nl.recv(8192)
    if len(reply) < _NLMSGHDR.size + 4:
        raise OSError("short sock_diag reply")
    _, kind, _, _, _ = _NLMSGHDR.unpack_from(reply)
    if kind == NLMSG_ERROR:
        (errno,) = struct.unpack_from("=i", reply, _NLMSGHDR.size)
        if -errno == 2:  # ENOENT: no such socket
            return None
        raise OSError(-errno, os.strerror(-errno))
    if kind != SOCK_DIAG_BY_FAMILY or len(reply) < _MSG_TAIL_OFFSET + _MSG_TAIL.size:
        raise OSError(f"unexpected sock_diag reply (type {kind})")
    # The kernel's lookup falls back to a listening socket when no connection matches
    # (the client left, and something listens on its port): only a connection whose
    # four addresses are the ones asked for is the client's.
    _, state, _, _ = _MSG_HEAD.unpack_from(reply, _NLMSGHDR.size)
    found = reply[_NLMSGHDR.size + _MSG_HEAD.size:][:_SOCKID.size]
    if state == TCP_LISTEN or found != sockid[:_SOCKID.size]:
        return None
    _, _, _, uid, inode = _MSG_TAIL.unpack_from(reply, _MSG_TAIL_OFFSET)
    return uid, inode


def _proc_hex(address: bytes) -> str:
    """An address as /proc/net/tcp prints it: each 32-bit word read in host order."""
    return "".join(f"{word:08X}" for word in struct.unpack(f"={len(address) // 4}I",
                                                             address))


def _proc_owner(family: int, peer: bytes, peer_port: int, local: bytes,
                local_port: int) -> tuple[int, int] | None:
    """The same answer from /proc/net/tcp{,6} (a scan of the table)."""
    table = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    wanted_local = f"{_proc_hex(peer)}:{peer_port:04X}"
    wanted_remote = f"{_proc_hex(local)}:{local_port:04X}"
    with open(table, encoding="ascii") as rows:
        next(rows)  # the header
        for row in rows:
            fields = row.split()
            # State 0A is LISTEN: never the client's end of a connection.
            if len(fields) >= 10 and fields[1] == wanted_local \
                    and fields[2] == wanted_remote and fields[3] != "0A":
                return int(fields[7]), int(fields[9])
    return None


def tcp_peer_uid(peer: Address, local: Address) -> int | None:
    """The uid owning the client's end of the TCP connection from ``peer`` to ``local``
    (our end), or None when no open socket of this machine is that end."""
    global _netlink_refused
    family, peer_ip, local_ip = _family_and_addresses(peer, local)
    args = (family, peer_ip, int(peer[1]), local_ip, int(local[1]))
    owner = None
    if not _netlink_refused:
        try:
            owner = _netlink_owner(*args)
        except OSError as exc:
            _netlink_refused = True
            log.warning("HTTP: the kernel's socket diagnostics cannot be asked (%s); "
                        "reading /proc/net/tcp to identify callers instead", exc)
    if _netlink_refused:
        try:
            owner = _proc_owner(*args)
        except OSError as exc:
            log.warning("HTTP: cannot read the kernel's TCP table: %s", exc)
            return None
    if owner is None:
        return None
    uid, inode = owner
    return uid if inode != 0 else None


def user_groups(uid: int) -> tuple[int, frozenset[int]]:
    """(primary gid, every group) of ``uid`` from the user database: a TCP peer's
    process is unknown, so its own supplementary groups cannot be read from /proc. A uid
    without a passwd entry has its uid as gid and no other group."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return uid, frozenset()
    try:
        groups = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except OSError:
        groups = frozenset()
    return entry.pw_gid, groups | {entry.pw_gid}


def is_loopback(address: Address | None) -> bool:
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(str(address[0]).split("%")[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
