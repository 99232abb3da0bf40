"""The daemon under pressure and under a service manager: queue, fairness, cancellation,
deadlines, slow readers, limits, signals, reload, sd_notify and socket activation."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from qvld.errors import BadRequest, Busy, Timeout
from tests.conftest import NOBODY, TINY, Daemon, read_replies, run_as, wait_for

LONG = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True,
        "temperature": 0}
ONE_WORKER = ["--set", "engine.infer_requests=1",
              "--set", "engine.max_sequences=1", "--set", "engine.max_new_tokens=4000",
              "--set", "engine.default_max_tokens=128"]


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def gen(rid: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "op": "generate", "params": {**LONG, "max_tokens": max_tokens, **extra}}


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    daemon = Daemon(tmp_path_factory.mktemp("one"), args=[
        *ONE_WORKER, *sets("server.queue_max=2", "server.read_timeout_s=0.5")]).start()
    yield daemon
    assert daemon.stop() == 0, daemon.log()


def test_busy_beyond_the_queue(one_worker: Daemon) -> None:
    with one_worker.client() as client:
        for rid in (1, 2, 3):  # one runs, two wait: the queue (2) is full
            client.send(gen(rid, 600))
        one_worker.wait_queue(running=1, waiting=2)
        client.send(gen(4, 5))
        replies = {}
        while len(replies) < 4:
            reply = client.receive()
            replies[reply["id"]] = reply
    assert replies[4]["error"]["code"] == "busy" and replies[4]["error"]["retryable"]
    assert all(replies[r]["ok"] for r in (1, 2, 3))


def test_cancel_by_disconnect_frees_the_worker_within_a_step(one_worker: Daemon) -> None:
    first = one_worker.client()
    first.connect()
    first.send(gen(1, 4000, stream=True))
    assert first.receive()["event"] == "token"  # it is running
    first.close()
    with one_worker.client() as client:
        result = client.generate({**LONG, "max_tokens": 3})
    # 4000 tokens would take seconds; the next request waited for about one step.
    assert result["timings"]["queue_s"] < 0.5, result["timings"]


def test_deadline_running_and_queued(one_worker: Daemon) -> None:
    with one_worker.client() as client:
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            client.generate({**LONG, "max_tokens": 4000, "deadline_s": 0.3})
        assert time.monotonic() - t0 < 2.0
        client.send(gen(1, 1500))
        one_worker.wait_queue(running=1)
        client.send(gen(2, 5, deadline_s=0.2))
        replies = {}
        while len(replies) < 2:
            reply = client.receive()
            replies[reply["id"]] = reply
    assert replies[2]["error"]["code"] == "timeout"
    # It never ran: its deadline passed while it was queued or, on a loaded machine, while
    # the prepare stage still held it.
    message = replies[2]["error"]["message"]
    assert "queued" in message or "before the request was prepared" in message, message
    assert replies[1]["ok"]


def test_partial_frame_times_out(one_worker: Daemon) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(one_worker.socket))
    sock.sendall(struct.pack(">I", 100) + b"x" * 10)
    t0 = time.monotonic()
    assert sock.recv(1) == b""  # closed by the daemon
    assert time.monotonic() - t0 < 5
    sock.close()
    with one_worker.client() as client:
        assert client.health()["ready"]


def finished_generations(log: str) -> list[tuple[int, int]]:
    """(uid, request id) of each generation, in the order the daemon answered them."""
    return [(int(uid), int(rid)) for rid, uid in re.findall(
        r"request \d+/(\d+) uid=(\d+) op=generate outcome=\w+", log)]


def stages(daemon: Daemon) -> list[tuple[int, str]]:
    """(uid, stage) of each generation the daemon holds, from the status op."""
    with daemon.client(timeout=10) as client:
        return sorted((g["uid"], g["stage"]) for g in client.status()["generations"])


def test_fairness_between_two_uids(shared_dir: Path) -> None:
    daemon = Daemon(shared_dir, args=[*ONE_WORKER, *sets(
        "server.socket_mode=0666", f"server.allow_uids=[{NOBODY}]")]).start()
    try:
        with daemon.client() as client:
            # uid 0: one running (long enough to outlast any start-up), three waiting.
            client.send(gen(1, 4000))
            for rid in (2, 3, 4):
                client.send(gen(rid, 50))
            daemon.wait_queue(running=1, waiting=3)
            other = run_as(NOBODY, daemon.socket, [gen(1, 50)], wait=False)
            # uid 65534's waits for a place behind uid 0's three: encoded, in the step
            # loop's own queue (its stage is "encoding" until then, counted as waiting).
            wait_for(lambda: stages(daemon) == [(0, "running"), *[(0, "waiting")] * 3,
                                                (NOBODY, "waiting")], 30,
                     "uid 65534's generation to wait for a place", detail=daemon.log)
            client.send({"id": 9, "op": "cancel", "params": {"target": 1}})
            replies: dict[int, dict[str, Any]] = {}
            while len(replies) < 5:
                reply = client.receive()
                replies[reply["id"]] = reply
        assert isinstance(other, subprocess.Popen)
        assert read_replies(other)[-1][1]["ok"]
        assert replies[1]["result"]["finish_reason"] == "cancelled"
        assert all(replies[rid]["ok"] for rid in (2, 3, 4, 9)), replies
        # uid 65534 came last but ran next: before every waiting job of uid 0. The order
        # is the daemon's own (its request log), not arrival times in two processes.
        order = [entry for entry in finished_generations(daemon.log()) if entry != (0, 1)]
        assert order == [(NOBODY, 1), (0, 2), (0, 3), (0, 4)], daemon.log()
    finally:
        assert daemon.stop() == 0


def test_slow_reader_is_cut_off_while_others_are_served(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, args=[*sets("engine.max_new_tokens=4000",
                                          "server.send_buffer_bytes=4096")]).start()
    try:
        slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(str(daemon.socket))
        from qvld import protocol

        slow.sendall(protocol.pack(gen(1, 4000, stream=True)))
        with daemon.client() as client:
            for _ in range(3):
                assert client.generate({**LONG, "max_tokens": 20})["finish_reason"] == "length"
        wait_for(lambda: "not reading; cutting it off" in daemon.log(), 20,
                 "the slow reader to be cut off", detail=daemon.log)
        slow.settimeout(10)
        received = 0
        while chunk := slow.recv(65536):
            received += len(chunk)
        assert received < 4000 * 40  # it never got the whole stream
        slow.close()
    finally:
        assert daemon.stop() == 0


def test_connection_limit(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, args=sets("server.max_connections=2")).start()
    try:
        a, b = daemon.client(), daemon.client()
        assert a.health()["ready"] and b.health()["ready"]
        with daemon.client() as third, pytest.raises(Busy, match="connections"):
            third.health()
        a.close()
        # A new connection is served once the daemon has noticed that a left.
        wait_for(daemon.serves_a_new_connection, 10, "a connection served after a closed")
        b.close()
    finally:
        assert daemon.stop() == 0


# -- signals --------------------------------------------------------------------------


def test_sigterm_drains_requests_in_flight(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, args=[*ONE_WORKER, *sets("server.drain_timeout_s=20")]).start()
    with daemon.client() as client:
        client.send(gen(1, 300))
        client.send(gen(2, 300))
        daemon.wait_queue(running=1, waiting=1)
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGTERM)
        # No new connections: the socket goes at once, while both are still to finish.
        wait_for(lambda: not daemon.socket.exists(), 10, "the socket to be removed",
                 detail=daemon.log)
        replies = {}
        while len(replies) < 2:
            reply = client.receive()
            replies[reply["id"]] = reply
    assert daemon.stop() == 0
    # Both finished whole, the waiting one included.
    assert [replies[i]["result"]["finish_reason"] for i in (1, 2)] == ["length", "length"]
    assert "draining" in daemon.log()


def test_drain_timeout_cancels_the_rest(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, args=[*ONE_WORKER, *sets("server.drain_timeout_s=0.3")]).start()
    with daemon.client() as client:
        client.send(gen(1, 4000))
        daemon.wait_queue(running=1)
        assert daemon.proc is not None
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        reply = client.receive()
    assert daemon.stop() == 0
    assert time.monotonic() - t0 < 5
    assert reply["ok"] and reply["result"]["finish_reason"] == "cancelled"
    assert 0 < len(reply["result"]["token_ids"]) < 4000


def test_second_sigint_forces(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, args=[*ONE_WORKER, *sets("server.drain_timeout_s=60")]).start()
    # watcher connects now: the socket goes with the first SIGINT.
    with daemon.client() as client, daemon.client() as watcher:
        client.send(gen(1, 4000))
        daemon.wait_queue(running=1)
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGINT)
        wait_for(lambda: watcher.health()["state"] == "draining", 10, "the drain to start",
                 detail=daemon.log)
        assert daemon.proc.poll() is None  # still draining: the generation still runs
        daemon.proc.send_signal(signal.SIGINT)
        reply = client.receive()
        assert daemon.proc.wait(10) == 0
    assert reply["result"]["finish_reason"] == "cancelled"
    daemon.stop()


def variant_model(tmp_path: Path) -> Path:
    """The tiny model with a different default system prompt: other prompts, other answers."""
    model = tmp_path / "variant"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("images", "reference*"))
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        "<|im_start|>system\nYou are qvld, reloaded.<|im_end|>\n" + template)
    return model


def test_sighup_reload_to_a_good_then_a_broken_model(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path)
    config = tmp_path / "qvld.yaml"
    daemon.argv.remove("--model")
    daemon.argv.remove(str(TINY))
    config_body = "model:\n  path: {}\n"
    config.write_text(config_body.format(TINY))
    daemon.start()
    question = {"messages": [{"role": "user", "content": "What is this?"}], "temperature": 0,
                "max_tokens": 12}
    try:
        with daemon.client() as client:
            before = client.generate(question)["token_ids"]
            config.write_text(config_body.format(variant_model(tmp_path)))
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: "variant" in client.status()["model"]["path"], 30,
                     "the reloaded model to serve", detail=daemon.log)
            after = client.generate(question)["token_ids"]
            assert after != before
            # A broken model: the reload fails and the previous one keeps serving.
            broken = tmp_path / "broken"
            broken.mkdir()
            config.write_text(config_body.format(broken))
            out = daemon.qvlctl("reload")
            assert out.returncode == 1, out
            assert b"reload failed" in out.stderr
            assert client.health()["ready"]
            assert client.generate(question)["token_ids"] == after
            assert "variant" in client.status()["model"]["path"]
    finally:
        assert daemon.stop() == 0
    assert "reload failed, still serving the previous model" in daemon.log()


# -- systemd --------------------------------------------------------------------------


def test_sd_notify_messages_arrive_in_order(tmp_path: Path) -> None:
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(30)
    daemon = Daemon(tmp_path)
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="400000")
    daemon._log = open(daemon.log_path, "wb")  # noqa: SIM115
    daemon.proc = subprocess.Popen(daemon.argv, stdout=daemon._log, stderr=subprocess.STDOUT,
                                   env=env)
    messages: list[str] = []

    def until(predicate: str) -> None:
        while not any(predicate in m for m in messages):
            messages.append(notify.recv(4096).decode())

    until("READY=1")
    until("WATCHDOG=1")
    daemon.proc.send_signal(signal.SIGHUP)
    until("RELOADING=1")
    until("READY=1\nSTATUS=ready")
    assert daemon.stop() == 0
    notify.settimeout(2)
    try:
        while True:
            messages.append(notify.recv(4096).decode())
    except TimeoutError:
        pass
    flat = [line for m in messages for line in m.split("\n")]
    first = {key: next(i for i, line in enumerate(flat) if line.startswith(key))
             for key in ("STATUS=loading", "EXTEND_TIMEOUT_USEC=", "READY=1", "WATCHDOG=1",
                         "RELOADING=1", "STOPPING=1")}
    assert first["STATUS=loading"] < first["READY=1"] < first["RELOADING=1"] < first[
        "STOPPING=1"]
    assert first["EXTEND_TIMEOUT_USEC="] < first["READY=1"] < first["WATCHDOG=1"]
    assert any(line.startswith("MONOTONIC_USEC=") for line in flat)
    notify.close()


def test_socket_activation_serves_on_fd_3(tmp_path: Path) -> None:
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    fd = listener.fileno()
    daemon = Daemon(tmp_path, socket_path=tmp_path / "unused.sock")
    # What systemd does: the socket on fd 3, LISTEN_PID = the pid that then execs qvld.
    activate = ("import os, sys; os.dup2(int(sys.argv[1]), 3); "
                "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); "
                "os.execv(sys.argv[2], sys.argv[2:])")
    daemon._log = open(daemon.log_path, "wb")  # noqa: SIM115
    daemon.proc = subprocess.Popen([sys.executable, "-c", activate, str(fd), *daemon.argv],
                                   pass_fds=(fd,), stdout=daemon._log,
                                   stderr=subprocess.STDOUT)
    listener.close()
    daemon.socket = path
    daemon.wait_ready()
    try:
        with daemon.client() as client:
            assert client.generate({**LONG, "max_tokens": 4})["finish_reason"] == "length"
        assert not (tmp_path / "unused.sock").exists()
        assert "socket activation" in daemon.log()
    finally:
        assert daemon.stop() == 0
    assert path.exists()  # systemd's socket is systemd's to remove


def test_qvlctl_reload_needs_admin_and_reports(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).start()
    try:
        out = daemon.qvlctl("reload", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["reloaded"] is True
    finally:
        assert daemon.stop() == 0


def test_memory_budget_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    # tiny at f32: 2 (K,V) x 3 layers x 2 KV heads x 32 dims x 4 bytes = 1.5 KiB/token.
    daemon = Daemon(tmp_path, args=sets("engine.kv_cache_mb=1",
                                        "engine.max_new_tokens=4000")).start()
    try:
        with daemon.client() as client:
            # More than the whole budget: never retryable, so not busy.
            with pytest.raises(BadRequest, match="KV cache") as info:
                client.generate({**LONG, "max_tokens": 1000})
            assert not info.value.retryable
            assert client.generate({**LONG, "max_tokens": 300})["finish_reason"] == "length"
    finally:
        assert daemon.stop() == 0
