"""Sessions through the daemon: exact follow-ups, ownership, `qvlctl sessions` and chat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NOBODY, TINY, Daemon, load_reference, run_as, with_image_bytes

SESSIONS = load_reference(TINY)["sessions"]


def test_session_follow_ups_over_the_socket_equal_transformers(daemon: Daemon) -> None:
    for session in SESSIONS:
        with daemon.client() as client:
            for turn in session["turns"]:
                result = client.generate({
                    "messages": with_image_bytes(turn["messages"], TINY), "temperature": 0,
                    "max_tokens": turn["max_new_tokens"], "session": f"s-{session['name']}"})
                assert result["token_ids"] == turn["token_ids"]
    out = daemon.qvlctl("sessions", "--json")
    listed = {s["id"]: s for s in json.loads(out.stdout)}
    for session in SESSIONS:
        assert listed[f"s-{session['name']}"]["turns"] == len(session["turns"])
    out = daemon.qvlctl("sessions")
    assert out.returncode == 0 and b"TURNS" in out.stdout
    assert daemon.qvlctl("sessions", "--close", f"s-{SESSIONS[0]['name']}").returncode == 0
    assert daemon.qvlctl("sessions", "--close", "no-such").returncode == 4


def test_chat_keeps_one_session_and_closes_it(daemon: Daemon, tmp_path: Path) -> None:
    image = TINY / "images" / "photo.png"
    script = f"What is in this picture?\n/image {TINY / 'images' / 'gray.png'}\nAnd this?\n" \
             f"/image {tmp_path / 'missing.png'}\n/help\nThanks.\n/quit\n"
    out = subprocess.run([sys.executable, "-m", "qvlctl.cli", "--socket", str(daemon.socket),
                          "chat", str(image), "--temperature", "0", "--max-tokens", "6"],
                         input=script.encode(), capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    answers = [line for line in out.stdout.decode().splitlines() if line.startswith("qvl> ")]
    assert len(answers) == 3
    err = out.stderr.decode()
    assert err.count("TTFT") == 3
    assert "cannot read" in err and "commands:" in err
    # The second and third turns reused the conversation's KV cache.
    assert err.count("cached") >= 2
    with daemon.client() as client:
        assert not [s for s in client.sessions() if s["id"].startswith("chat-")]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
def test_another_uid_cannot_read_continue_or_close_a_session(shared_dir: Path) -> None:
    daemon = Daemon(shared_dir, args=["--set", "server.socket_mode=0666",
                                      "--set", f"server.allow_uids=[{NOBODY}]"]).start()
    try:
        with daemon.client() as client:
            client.generate({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                             "session": "roots"})
            replies = run_as(NOBODY, daemon.socket, [
                {"id": 1, "op": "generate", "params": {
                    "messages": [{"role": "user", "content": "Hi"}], "session": "roots"}},
                {"id": 2, "op": "sessions", "params": {"action": "list"}},
                {"id": 3, "op": "sessions", "params": {"action": "close", "id": "roots"}},
                {"id": 4, "op": "sessions", "params": {"action": "list", "all": True}},
            ], finals=4)
            assert isinstance(replies, list)
            by_id = {r["id"]: r for _, r in replies}
            assert by_id[1]["error"]["code"] == "forbidden"
            assert by_id[2]["result"] == {"sessions": []}
            assert by_id[3]["error"]["code"] == "forbidden"
            assert by_id[4]["error"]["code"] == "forbidden"
            # Still there, unchanged, for its owner.
            mine = client.sessions()
            assert [(s["id"], s["turns"]) for s in mine] == [("roots", 1)]
            assert client.sessions(all_users=True)[0]["uid"] == 0  # root is an admin
    finally:
        assert daemon.stop() == 0
