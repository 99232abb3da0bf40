"""Sessions through the daemon: exact follow-ups, ownership, `qvlctl sessions` and chat."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    assert out.returncode == 0
    header, *rows = out.stdout.decode().splitlines()
    assert header.split() == ["ID", "USER", "TURNS", "TOKENS", "IMAGES", "SIZE", "AGE", "IDLE",
                              "BUSY"]
    assert all(s["user"] == f"uid:{s['uid']}" for s in listed.values())  # socket users
    first = next(r for r in rows if r.startswith(f"s-{SESSIONS[0]['name']} "))
    # aligned under the header; sizes and times for people; busy as yes/no
    assert first.index(first.split()[2]) == header.index("TURNS")
    assert re.search(r" \d+(\.\d)? (B|KiB|MiB) +[\d.]+ (s|min) ", first), first
    assert first.split()[-1] in ("yes", "no")
    assert daemon.qvlctl("sessions", "--close", f"s-{SESSIONS[0]['name']}").returncode == 0
    assert daemon.qvlctl("sessions", "--close", "no-such").returncode == 4


def test_chat_keeps_one_session_and_closes_it(daemon: Daemon, tmp_path: Path) -> None:
    image = TINY / "images" / "photo.png"
    script = f"What is in this picture?\n/image {TINY / 'images' / 'gray.png'}\nAnd this?\n" \
             f"/image {tmp_path / 'missing.png'}\n/help\nThanks.\n" \
             f"/video {TINY / 'images' / 'clip.mp4'}\nWhat happens in this clip?\n/quit\n"
    out = subprocess.run([sys.executable, "-m", "qvlctl.cli", "--socket", str(daemon.socket),
                          "chat", str(image), "--temperature", "0", "--max-tokens", "6"],
                         input=script.encode(), capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    answers = [line for line in out.stdout.decode().splitlines() if line.startswith("qvl> ")]
    assert len(answers) == 4
    err = out.stderr.decode()
    assert err.count("TTFT") == 4 and "(video attached to your next message" in err
    assert "cannot read" in err and "commands:" in err
    # The later turns reused the conversation's KV cache.
    assert err.count("cached") >= 3
    with daemon.client() as client:
        assert not [s for s in client.sessions() if s["id"].startswith("chat-")]


def test_only_a_committed_turn_creates_a_session(daemon: Daemon) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    with daemon.client() as client:
        with pytest.raises(Exception, match="max_tokens"):  # refused by validation
            client.generate({"messages": hi, "max_tokens": 0, "session": "refused"})
        with pytest.raises(Exception, match="deadline"):  # timed out while generating
            client.generate({"messages": hi, "max_tokens": 500, "ignore_eos": True,
                             "deadline_s": 0.05, "session": "timed-out"})
        ids = {s["id"] for s in client.sessions()}
        assert not ids & {"refused", "timed-out"}
        result = client.generate({"messages": hi, "max_tokens": 2, "session": "timed-out"})
        assert result["session"] == {"id": "timed-out", "turns": 1, "reset": False}


def test_a_lost_session_is_answered_afresh_and_says_so(daemon: Daemon) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    with daemon.client() as client:
        for n in range(9):  # one more than engine.sessions_per_user: lost-0 is evicted
            client.generate({"messages": hi, "max_tokens": 2, "session": f"lost-{n}"})
        result = client.generate({"messages": hi, "max_tokens": 2, "session": "lost-0"})
        assert result["session"] == {"id": "lost-0", "turns": 1, "reset": True}
        result = client.generate({"messages": hi, "max_tokens": 2, "session": "lost-0"})
        assert result["session"] == {"id": "lost-0", "turns": 2, "reset": False}
        caches = client.status()["caches"]
        listed = client.sessions()
        assert caches["sessions"] == len(listed) >= 8
        assert caches["sessions_bytes"] == sum(s["bytes"] for s in listed) > 0
        for n in range(9):
            client.close_session(f"lost-{n}")


def test_a_client_that_says_its_turns_is_refused_when_they_differ(daemon: Daemon) -> None:
    from qvld.errors import BadRequest, SessionLost

    hi = [{"role": "user", "content": "Hi"}]
    with daemon.client() as client:
        # Never held (a restarted daemon holds nothing): refused before anything runs.
        with pytest.raises(SessionLost, match="does not hold it"):
            client.generate({"messages": hi, "max_tokens": 2, "session": "turns-a",
                             "session_turns": 1})
        assert "turns-a" not in {s["id"] for s in client.sessions()}
        first = client.generate({"messages": hi, "max_tokens": 2, "session": "turns-a",
                                 "session_turns": 0})
        assert first["session"] == {"id": "turns-a", "turns": 1, "reset": False}
        second = client.generate({"messages": hi, "max_tokens": 2, "session": "turns-a",
                                  "session_turns": 1})
        assert second["session"]["turns"] == 2
        # It continued the history (the first turn's prompt and answer are in its prompt).
        assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] + 2
        with pytest.raises(SessionLost, match="holds 2"):  # a client a turn behind
            client.generate({"messages": hi, "max_tokens": 2, "session": "turns-a",
                             "session_turns": 1})
        client.close_session("turns-a")  # closed by its owner: no tombstone
        with pytest.raises(SessionLost, match="does not hold it"):
            client.generate({"messages": hi, "max_tokens": 2, "session": "turns-a",
                             "session_turns": 2})
        with pytest.raises(BadRequest, match="with session"):
            client.generate({"messages": hi, "max_tokens": 2, "session_turns": 0})
        assert client.health()["ready"]  # nothing else broke


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
def test_sessions_are_per_user_and_invisible_to_others(shared_dir: Path) -> None:
    daemon = Daemon(shared_dir, args=["--set", "server.socket_mode=0666",
                                      "--set", f"server.allow_uids=[{NOBODY}]"]).start()
    hi = [{"role": "user", "content": "Hi"}]

    def as_nobody(*calls: tuple[str, dict[str, object]]) -> dict[int, dict[str, Any]]:
        replies = run_as(NOBODY, daemon.socket, [
            {"id": n, "op": op, "params": p} for n, (op, p) in enumerate(calls, 1)],
            finals=len(calls))
        assert isinstance(replies, list)
        return {r["id"]: r for _, r in replies}

    try:
        with daemon.client() as client:
            client.generate({"messages": hi, "max_tokens": 2, "session": "roots"})
            # (Requests on one connection run concurrently: the turn first, alone.)
            by_id = as_nobody(
                ("generate", {"messages": hi, "max_tokens": 2, "session": "roots"}))
            by_id.update({n + 1: r for n, r in as_nobody(
                ("sessions", {"action": "list"}),
                ("sessions", {"action": "close", "id": "nobodys-other"}),
                ("sessions", {"action": "close", "id": "roots", "uid": 0}),
                ("sessions", {"action": "list", "all": True}),
                ("generate", {"messages": hi, "max_tokens": 0, "session": "refused"}),
            ).items()})
            # The same id is Nobody's own session: no error tells it root has one.
            assert by_id[1]["result"]["session"] == {"id": "roots", "turns": 1,
                                                     "reset": False}
            assert [(s["id"], s["uid"]) for s in by_id[2]["result"]["sessions"]] == [
                ("roots", NOBODY)]
            assert by_id[3]["result"] == {"closed": False}
            assert by_id[4]["error"]["code"] == "forbidden"  # whether or not it exists
            assert by_id[5]["error"]["code"] == "forbidden"
            assert by_id[6]["error"]["code"] == "bad_request"
            # Root's own session is untouched; an admin sees and may close everyone's.
            assert [(s["id"], s["turns"]) for s in client.sessions()] == [("roots", 1)]
            everyone = {(s["id"], s["uid"]) for s in client.sessions(all_users=True)}
            assert everyone == {("roots", 0), ("roots", NOBODY)}
            assert client.call("sessions", {"action": "close", "id": "roots",
                                            "uid": NOBODY}) == {"closed": True}
            assert [(s["id"], s["turns"]) for s in client.sessions()] == [("roots", 1)]
            # Nobody learns on their next turn that their context is gone.
            again = as_nobody(("generate", {"messages": hi, "max_tokens": 2,
                                            "session": "roots"}))
            assert again[1]["result"]["session"] == {"id": "roots", "turns": 1,
                                                     "reset": True}
    finally:
        assert daemon.stop() == 0
