"""sd_notify and socket activation, stdlib only; silent when not run by systemd."""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


class Notifier:
    """Sends sd_notify datagrams to $NOTIFY_SOCKET (a no-op without one)."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> bool:
        if self._sock is None or not self.address:
            return False
        target = self.address
        if target.startswith("@"):  # abstract namespace
            target = "\0" + target[1:]
        try:
            self._sock.sendto("\n".join(lines).encode(), target)
        except OSError:
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def listen_fds(unset_environment: bool = True) -> list[int]:
    """File descriptors passed by socket activation (LISTEN_FDS for this very process)."""
    return [fd for fd, _ in named_listen_fds(unset_environment)]


def named_listen_fds(unset_environment: bool = True) -> list[tuple[int, str]]:
    """The same, each with its FileDescriptorName= (LISTEN_FDNAMES; "unknown" where
    systemd gave none): qvld.socket and qvld-http.socket reach one process."""
    try:
        pid = int(os.environ.get("LISTEN_PID", ""))
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    if pid != os.getpid() or count < 1:
        return []
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    if unset_environment:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(key, None)
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count))
    for fd in fds:
        os.set_inheritable(fd, False)
    names += ["unknown"] * (count - len(names))
    return list(zip(fds, names[:count], strict=True))
