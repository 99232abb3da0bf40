"""The access rule, with a client really running as another user (SO_PEERCRED)."""

from __future__ import annotations

import grp
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import NOBODY, TINY, Daemon, run_as

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")


def health_as(socket_path: Path, uid: int, extra_groups: list[int] | None = None
              ) -> dict[str, Any]:
    replies = run_as(uid, socket_path, [{"id": 1, "op": "health"}], extra_groups=extra_groups)
    assert isinstance(replies, list) and len(replies) == 1
    return replies[0][1]


def start(shared_dir: Path, *sets: str) -> Daemon:
    return Daemon(shared_dir, args=["--set", "server.socket_mode=0666",
                                    *(a for s in sets for a in ("--set", s))]).start()


def test_other_uid_is_forbidden_by_default(shared_dir: Path) -> None:
    daemon = start(shared_dir)
    try:
        reply = health_as(daemon.socket, NOBODY)
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
        reply = health_as(daemon.socket, NOBODY)
        assert reply == {"id": 1, "ok": True, "result": {"state": "ready", "ready": True}}
        # Allowed, but not an admin: admin ops are refused (a drain's status is anyone's).
        for op, params in (("reload", {}), ("drain", {}), ("drain", {"action": "stop"})):
            replies = run_as(NOBODY, daemon.socket, [{"id": 2, "op": op, "params": params}])
            assert isinstance(replies, list)
            assert replies[0][1]["error"]["code"] == "forbidden", (op, params)
        replies = run_as(NOBODY, daemon.socket, [{"id": 3, "op": "drain",
                                                  "params": {"action": "status"}}])
        assert isinstance(replies, list)
        assert replies[0][1]["result"] == {"state": "ready", "in_flight": 0}
        with daemon.client() as client:
            assert client.health()["ready"]
    finally:
        assert daemon.stop() == 0


def test_supplementary_group_membership_counts(shared_dir: Path) -> None:
    users = grp.getgrnam("users").gr_gid
    daemon = start(shared_dir, "server.allow_groups=[users]")
    try:
        assert health_as(daemon.socket, NOBODY, [users])["ok"] is True
        assert health_as(daemon.socket, NOBODY)["error"]["code"] == "forbidden"
    finally:
        assert daemon.stop() == 0


def as_nobody(daemon: Daemon, *calls: tuple[str, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Run ``calls`` (op, params) as uid NOBODY on one connection; the replies by id."""
    replies = run_as(NOBODY, daemon.socket, [
        {"id": n, "op": op, "params": params} for n, (op, params) in enumerate(calls, 1)],
        finals=len(calls))
    assert isinstance(replies, list)
    return {reply["id"]: reply for _, reply in replies}


def test_status_and_config_show_a_non_admin_only_their_own(shared_dir: Path) -> None:
    daemon = start(shared_dir, f"server.allow_uids=[{NOBODY}]")
    try:
        with daemon.client() as client:  # root: an admin, and a failed request of its own
            with pytest.raises(Exception, match="image"):
                client.generate({"messages": [{"role": "user", "content": [
                    {"type": "image", "image": b"not an image"}]}], "max_tokens": 2})
            admin_status, admin_config = client.status(), client.config()
        replies = as_nobody(daemon, ("status", {}), ("config", {}))
        status, config = replies[1]["result"], replies[2]["result"]
        # Root's failure, the model's path and who may connect are not a user's business.
        assert any(e["code"] == "image_invalid" for e in admin_status["last_errors"])
        assert status["last_errors"] == []
        assert all(g["uid"] == NOBODY for g in status["generations"])
        assert admin_status["model"]["path"] == str(TINY)
        assert status["model"]["path"] == "<hidden>"
        assert status["model"]["name"] == admin_status["model"]["name"]
        for section, key in [("server", "allow_uids"), ("server", "allow_groups"),
                             ("server", "admin_groups"), ("server", "socket"),
                             ("model", "path"), ("model", "cache_dir"),
                             ("http", "api_keys_file")]:
            assert config[section][key] == "<hidden>", key
        assert admin_config["server"]["allow_uids"] == [NOBODY]
        assert admin_config["model"]["path"] == str(TINY)
        assert config["engine"] == admin_config["engine"]  # limits stay visible
    finally:
        assert daemon.stop() == 0


def test_a_peers_groups_are_those_it_connected_with_not_procs_later(shared_dir: Path
                                                                   ) -> None:
    """#46: groups were read from /proc/PID at the connection's first request; with the
    pid reused an unallowed uid borrowed an allowed user's groups. SO_PEERGROUPS gives
    the groups of the connect(): still right after the peer process is gone (a group
    the user database does not give uid 65534, here), whatever runs under its pid now."""
    import shutil
    import socket
    import subprocess

    from qvld.server import Peer

    path = shared_dir / "s"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o777)
    listener.listen(1)
    borrowed = 4242  # in no group list of the user database
    child = subprocess.run(
        [shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3", "-c",
         "import socket, sys; s = socket.socket(socket.AF_UNIX); "
         "s.connect(sys.argv[1]); s.send(b'x')", str(path)],
        user=NOBODY, group=NOBODY, extra_groups=[borrowed], capture_output=True, timeout=60,
        cwd="/")
    assert child.returncode == 0, child.stderr
    conn, _ = listener.accept()
    with conn, listener:
        peer = Peer.of(conn)  # the child has exited: /proc/PID is gone or someone else
    assert peer.uid == NOBODY and borrowed in peer.groups
