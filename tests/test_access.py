"""The access rule, with a client really running as another user (SO_PEERCRED)."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qvld import protocol
from tests.conftest import Daemon

NOBODY = 65534
# A stdlib-only client, so that the other user needs nothing of this checkout.
CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(30)
s.connect(sys.argv[1])
s.sendall(bytes.fromhex(sys.argv[2]))
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
    if len(data) >= 4 and len(data) >= 4 + int.from_bytes(data[:4], "big"):
        break
print(data.hex())
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="qvld-access-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def health_as(socket_path: Path, uid: int, gid: int,
              extra_groups: list[int] | None = None) -> dict[str, Any]:
    python = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
    frame = protocol.pack({"id": 1, "op": "health"}).hex()
    out = subprocess.run([python, "-c", CLIENT, str(socket_path), frame], user=uid, group=gid,
                         extra_groups=extra_groups or [], capture_output=True, timeout=60,
                         check=False, cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr.decode()
    data = bytes.fromhex(out.stdout.decode().strip())
    return dict(protocol.unpack(data[4:]))


def start(shared_dir: Path, *sets: str) -> Daemon:
    return Daemon(shared_dir, args=["--set", "server.socket_mode=0666",
                                    *(a for s in sets for a in ("--set", s))]).start()


def test_other_uid_is_forbidden_by_default(shared_dir: Path) -> None:
    daemon = start(shared_dir)
    try:
        reply = health_as(daemon.socket, NOBODY, NOBODY)
        assert reply["ok"] is False and reply["error"]["code"] == "forbidden"
        assert reply["id"] == 1  # the refused request is answered, then the line closed
        assert "uid 65534" in reply["error"]["message"]
        with daemon.client() as client:  # root is always allowed
            assert client.health()["ready"]
    finally:
        assert daemon.stop() == 0
    assert "refused uid 65534" in daemon.log()


def test_allow_uids_admits_that_uid(shared_dir: Path) -> None:
    daemon = start(shared_dir, f"server.allow_uids=[{NOBODY}]")
    try:
        reply = health_as(daemon.socket, NOBODY, NOBODY)
        assert reply == {"id": 1, "ok": True, "result": {"state": "ready", "ready": True}}
    finally:
        assert daemon.stop() == 0


def test_supplementary_group_membership_counts(shared_dir: Path) -> None:
    users = grp.getgrnam("users").gr_gid
    daemon = start(shared_dir, "server.allow_groups=[users]")
    try:
        assert health_as(daemon.socket, NOBODY, NOBODY, [users])["ok"] is True
        assert health_as(daemon.socket, NOBODY, NOBODY)["error"]["code"] == "forbidden"
    finally:
        assert daemon.stop() == 0
