"""Who is calling over HTTP, against the real daemon: without a keys file a caller is the
uid the kernel says owns its end of the connection (loopback TCP, or SO_PEERCRED on an
HTTP Unix socket), authorised like a socket caller and served as itself; with a keys
file a key is the identity, and the file must be one only root or the daemon can
change."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from qvld.http.keys import hash_key
from tests.conftest import NOBODY, Daemon, wait_for
from tests.test_http import HttpDaemon

# A uid with no passwd entry that the daemons below allow (server.allow_uids).
ALLOWED = 65533

# A stdlib-only HTTP client for another uid: argv = TARGET METHOD PATH BODY HEADERS-JSON,
# TARGET "tcp:PORT" or "unix:PATH"; prints the status, then the body.
CLIENT = """
import http.client, json, socket, sys
target, method, path, body, headers = sys.argv[1:6]
class UnixConnection(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(target[5:])
if target.startswith("unix:"):
    conn = UnixConnection("localhost", timeout=60)
else:
    conn = http.client.HTTPConnection("127.0.0.1", int(target[4:]), timeout=60)
conn.request(method, path, body=body.encode() or None, headers=json.loads(headers))
response = conn.getresponse()
print(response.status)
print(response.read().decode())
"""


def http_as(uid: int, target: str, body: dict[str, Any] | None = None,
            headers: dict[str, str] | None = None, method: str = "POST",
            path: str = "/v1/chat/completions") -> tuple[int, Any]:
    """One request from a process running as ``uid``: (status, parsed body)."""
    python = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
    headers = {"Content-Type": "application/json", **(headers or {})}
    data = json.dumps(body) if body is not None else ""
    if uid == os.getuid():
        argv, extra = [sys.executable, "-c", CLIENT], {}
    else:
        argv = [python, "-c", CLIENT]
        extra = {"user": uid, "group": uid, "extra_groups": [], "cwd": "/",
                 "env": {"PATH": "/usr/bin:/bin"}}
    out = subprocess.run([*argv, target, method, path, data, json.dumps(headers)],
                         capture_output=True, text=True, timeout=120, check=False,
                         **extra)  # type: ignore[call-overload]
    assert out.returncode == 0, out.stderr
    status, _, text = out.stdout.partition("\n")
    try:
        return int(status), json.loads(text)
    except ValueError:
        return int(status), text


def ask(text: str, max_tokens: int = 2) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0}


# Long enough for whole 32-row KV blocks to be cached after it.
PROMPT = "Describe in detail how a receipt printer works. " * 8


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("identity"), args=[
        "--set", "server.allow_groups=[]", "--set", f"server.allow_uids=[{ALLOWED}]"]).start()
    try:
        yield d
    finally:
        d.stop()


def test_root_is_served_and_a_uid_the_socket_refuses_is_refused(daemon: HttpDaemon) -> None:
    tcp = f"tcp:{daemon.port}"
    status, body = http_as(0, tcp, ask("Hi"))
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    status, body = http_as(NOBODY, tcp, ask("Hi"))
    assert status == 403, body
    assert body["error"]["code"] == "forbidden"
    assert "uid 65534" in body["error"]["message"]
    # Every route that needs an identity refuses it; /health answers anyone.
    assert http_as(NOBODY, tcp, method="GET", path="/v1/models")[0] == 403
    assert http_as(NOBODY, tcp, method="GET", path="/health")[0] == 200
    # The same uid is refused on the Unix socket: one decision for both.
    with daemon.client() as client:
        assert client.health()["ready"]
    assert "uid=65534" in daemon.log()


def test_an_allowed_uid_is_served_as_itself(daemon: HttpDaemon) -> None:
    """Its sessions and caches are its own: root cannot continue them or see them."""
    tcp = f"tcp:{daemon.port}"
    session = {"X-Qvld-Session": "shared-name"}
    status, first = http_as(ALLOWED, tcp, ask(PROMPT), session)
    assert status == 200, first
    assert first["session"] == {"id": "shared-name", "turns": 1, "reset": False}
    status, again = http_as(ALLOWED, tcp, ask(PROMPT))
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    # Root asking the same prompt reuses nothing of the other user's KV cache...
    status, root = http_as(0, tcp, ask(PROMPT))
    assert status == 200 and root["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # ...and a session of the same name is a new one of its own.
    status, follow = http_as(0, tcp, ask("And then?"), session)
    assert status == 200 and follow["session"]["turns"] == 1
    assert follow["usage"]["prompt_tokens"] < first["usage"]["prompt_tokens"]
    # The generations were accounted to the uid (the log line of each request).
    assert f"uid={ALLOWED} op=generate outcome=ok" in daemon.log()


def test_an_authorization_header_is_ignored_without_a_keys_file(daemon: HttpDaemon) -> None:
    # Clients such as the openai package always send one.
    status, body = http_as(0, f"tcp:{daemon.port}", ask("Hi"),
                           {"Authorization": "Bearer anything"})
    assert status == 200, body
    status, body = http_as(NOBODY, f"tcp:{daemon.port}", ask("Hi"),
                           {"Authorization": "Bearer anything"})
    assert status == 403


def test_http_on_a_unix_socket_knows_its_callers(shared_dir: Path) -> None:
    path = shared_dir / "http.sock"
    d = Daemon(shared_dir, args=["--set", f"http.listen=unix:{path}",
                                 "--set", "server.allow_groups=[]",
                                 "--set", f"server.allow_uids=[{ALLOWED}]",
                                 "--set", "server.socket_mode=0666"]).start()
    try:
        assert oct(path.stat().st_mode & 0o777) == "0o666"
        target = f"unix:{path}"
        status, body = http_as(0, target, ask("Hi"))
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        status, body = http_as(NOBODY, target, ask("Hi"))
        assert status == 403 and body["error"]["code"] == "forbidden"
        status, body = http_as(ALLOWED, target, ask("Hi"))
        assert status == 200, body
        assert f"HTTP API on http+unix:{path}" in d.log()
    finally:
        assert d.stop() == 0
    assert not path.exists()  # the daemon removes the socket it made


def test_a_keys_file_others_can_write_is_refused(tmp_path: Path, shared_dir: Path) -> None:
    keys = shared_dir / "keys"
    keys.write_text(f"alice:{hash_key('qvld-test-key-alice')}\n")
    keys.chmod(0o666)
    check = subprocess.run([sys.executable, "-m", "qvld.cli", "check-config",
                            "--model", "tests/fixtures/models/tiny",
                            "--set", f"http.api_keys_file={keys}"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 78, check.stderr
    assert "writable by other users" in check.stderr
    d = HttpDaemon(tmp_path, args=["--set", f"http.api_keys_file={keys}"])
    d.start(wait_ready=False)
    assert d.proc is not None and d.proc.wait(60) == 78
    d.stop()
    assert "writable by other users" in d.log()


def test_a_reload_keeps_the_old_keys_when_the_file_became_writable(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    alice = "qvld-test-key-alice-0123456789"
    keys.write_text(f"alice:{hash_key(alice)}\n")
    keys.chmod(0o600)
    d = HttpDaemon(tmp_path, args=["--set", f"http.api_keys_file={keys}"]).start()
    try:
        mallory = "qvld-test-key-mallory-0123456"
        with keys.open("a") as file:
            file.write(f"mallory:{hash_key(mallory)}\n")
        keys.chmod(0o646)
        assert d.proc is not None
        d.proc.send_signal(1)
        wait_for(lambda: "reload failed" in d.log(), 60, "the refused reload", detail=d.log)
        assert d.log().count("writable by other users") == 1
        bearer = {"Authorization": f"Bearer {mallory}"}
        assert http_as(0, f"tcp:{d.port}", ask("Hi"), bearer)[0] == 401
        assert http_as(0, f"tcp:{d.port}", ask("Hi"),
                       {"Authorization": f"Bearer {alice}"})[0] == 200
    finally:
        d.stop()


def test_a_revoked_key_ends_its_sessions(tmp_path: Path) -> None:
    """A key issued again under a revoked name is a new user: nothing of the old key's
    sessions or caches comes with the name."""
    keys = tmp_path / "keys"
    old, new = "qvld-test-key-alice-old-000000", "qvld-test-key-alice-new-000000"
    keys.write_text(f"alice:{hash_key(old)}\nbob:{hash_key('qvld-test-key-bob-0000')}\n")
    keys.chmod(0o600)
    d = HttpDaemon(tmp_path, args=["--set", f"http.api_keys_file={keys}",
                                   "--set", "engine.max_new_tokens=30000",
                                   "--set", "engine.max_context_tokens=32768"]).start()
    try:
        target = f"tcp:{d.port}"
        session = {"X-Qvld-Session": "notes"}
        status, first = http_as(0, target, ask(PROMPT), {
            "Authorization": f"Bearer {old}", **session})
        assert status == 200 and first["session"]["turns"] == 1
        assert d.proc is not None
        # #46: a revoked key's generation in flight ran to its end.
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(http_as, 0, target, {**ask("Go on.", 10000), "ignore_eos": True},
                               {"Authorization": f"Bearer {old}"})
            wait_for(lambda: d.queue()[0] == 1, 60, "alice's long answer to run")
            keys.write_text(f"bob:{hash_key('qvld-test-key-bob-0000')}\n")  # alice revoked
            d.proc.send_signal(1)
            wait_for(lambda: "reload done" in d.log(), 60, "the reload", detail=d.log)
            status, cut = long.result(60)
        assert "API keys revoked: alice (sessions ended: 1, generations cancelled: 1)" \
            in d.log()
        assert status == 401 and "revoked while this generation ran" in \
            cut["error"]["message"], cut
        keys.write_text(f"bob:{hash_key('qvld-test-key-bob-0000')}\nalice:{hash_key(new)}\n")
        d.proc.send_signal(1)
        wait_for(lambda: d.log().count("reload done") == 2, 60, "the second reload",
                 detail=d.log)
        bearer = {"Authorization": f"Bearer {new}"}
        status, again = http_as(0, target, ask(PROMPT), {**bearer, **session})
        assert status == 200
        assert again["session"] == {"id": "notes", "turns": 1, "reset": False}
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert http_as(0, target, ask("Hi"), {"Authorization": f"Bearer {old}"})[0] == 401
    finally:
        d.stop()

