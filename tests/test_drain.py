"""The drain admin op (`qvlctl drain` / `resume`): a load balancer's way to take one
backend out gracefully. Against the real daemon, on its Unix socket and its HTTP port."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from qvld.errors import BadRequest, Unavailable
from tests.conftest import run_qvlctl, wait_for
from tests.test_http import HttpDaemon

LONG = {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 1500,
        "ignore_eos": True, "temperature": 0}
SHORT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("drain"),
                   args=["--set", "engine.max_new_tokens=2000"]).start()
    try:
        yield d
    finally:
        d.stop()


def start_long(daemon: HttpDaemon) -> tuple[threading.Thread, dict[str, Any],
                                              threading.Event]:
    """A long streaming generation on its own connection; the event is set at its first
    token (it is then admitted and running)."""
    result: dict[str, Any] = {}
    first = threading.Event()

    def run() -> None:
        try:
            with daemon.client() as client:
                result.update(client.generate(LONG, on_token=lambda *_: first.set()))
        except Exception as exc:  # the test says what went wrong
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: first.is_set() or not thread.is_alive(), timeout=60, detail=daemon.log)
    assert first.is_set(), result
    return thread, result, first


def metric(daemon: HttpDaemon, name: str) -> float:
    with daemon.client() as client:
        text = client.metrics()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(name + " "))


@pytest.mark.slow  # long: the default tier stays under 5 minutes
def test_a_drained_daemon_finishes_its_work_takes_no_new_and_resumes(
        daemon: HttpDaemon) -> None:
    thread, result, _ = start_long(daemon)
    out = run_qvlctl(daemon.socket, "drain", "--no-wait")
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == "drained: taking no new generations, " \
                                  "1 generation(s) still running\n"
    # Not ready on both front doors and in the metrics: a load balancer moves away ...
    with daemon.client() as client:
        assert client.health() == {"state": "drained", "ready": False}
        with pytest.raises(Unavailable, match="drained"):
            client.generate(SHORT)
    assert run_qvlctl(daemon.socket, "health").returncode == 5
    status, headers, body = daemon.request("GET", "/health")
    assert status == 503 and headers.get("Retry-After")
    status, _, body = daemon.request(
        "POST", "/v1/chat/completions", json.dumps({**SHORT, "model": "tiny"}).encode(),
        {"Content-Type": "application/json"})
    assert status == 503 and "drained" in body["error"]["message"]
    assert metric(daemon, "qvld_ready") == 0
    # ... while the admitted generation runs to its end, not cancelled.
    waited = run_qvlctl(daemon.socket, "drain", "--json")
    assert waited.returncode == 0
    assert json.loads(waited.stdout) == {"state": "drained", "in_flight": 0}
    thread.join(60)
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 1500
    # resume: ready again, on both doors
    resumed = run_qvlctl(daemon.socket, "resume")
    assert resumed.returncode == 0 and resumed.stdout == b"ready: taking generations again\n"
    with daemon.client() as client:
        assert client.health()["ready"]
        assert len(client.generate(SHORT)["token_ids"]) == 3
    assert daemon.request("GET", "/health")[0] == 200
    assert metric(daemon, "qvld_ready") == 1


def test_drain_waits_for_the_admitted_work(daemon: HttpDaemon) -> None:
    thread, result, _ = start_long(daemon)
    out = run_qvlctl(daemon.socket, "drain")  # waits, then says nothing runs
    thread.join(60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == b"drained: taking no new generations, nothing running\n"
    assert result["finish_reason"] == "length"
    assert run_qvlctl(daemon.socket, "resume").returncode == 0


@pytest.mark.slow  # long: the default tier stays under 5 minutes
def test_a_drain_that_outlasts_its_wait_exits_6_and_stays_drained(daemon: HttpDaemon) -> None:
    thread, _, _ = start_long(daemon)
    out = run_qvlctl(daemon.socket, "drain", "--wait-timeout", "0")
    assert out.returncode == 6
    assert b"still 1 generation(s) running after 0 s; the daemon stays drained" in out.stderr
    with daemon.client() as client:
        assert client.drain("status") == {"state": "drained", "in_flight": 1}
    thread.join(60)
    assert run_qvlctl(daemon.socket, "resume").returncode == 0


def test_a_reload_keeps_a_drained_daemon_drained(daemon: HttpDaemon) -> None:
    with daemon.client() as client:
        client.drain("start")
        assert client.reload()["reloaded"]
        assert client.health()["state"] == "drained"
        with pytest.raises(Unavailable):
            client.generate(SHORT)
        client.drain("stop")
        assert client.health()["ready"]


def test_a_drain_with_an_unknown_action_is_a_bad_request(daemon: HttpDaemon) -> None:
    with daemon.client() as client, pytest.raises(BadRequest, match="start, stop or status"):
        client.call("drain", {"action": "pause"})
