from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from qvld.systemd import Notifier, listen_fds


def test_notifier_is_silent_without_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    assert notifier.ready() is False


def test_notifier_sends_datagrams(tmp_path: Path) -> None:
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(str(tmp_path / "n.sock"))
    sink.settimeout(5)
    notifier = Notifier(str(tmp_path / "n.sock"))
    assert notifier.ready("serving")
    assert sink.recv(100) == b"READY=1\nSTATUS=serving"
    notifier.close()
    sink.close()


def test_notifier_abstract_namespace() -> None:
    name = f"qvld-test-{os.getpid()}"
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind("\0" + name)
    sink.settimeout(5)
    assert Notifier("@" + name).status("x")
    assert sink.recv(100) == b"STATUS=x"
    sink.close()


def test_listen_fds_only_for_this_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_FDS", "1")
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    assert listen_fds() == []
    monkeypatch.setenv("LISTEN_PID", "junk")
    assert listen_fds() == []


def test_listen_fds_takes_fd_3_and_unsets_the_environment() -> None:
    # In a child process: fd 3 of this one belongs to pytest.
    code = (
        "import os, socket; from qvld.systemd import listen_fds\n"
        "a, b = socket.socketpair(); os.dup2(a.fileno(), 3)\n"
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1')\n"
        "print(listen_fds(), 'LISTEN_FDS' in os.environ, os.get_inheritable(3))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["[3]", "False", "False"]
