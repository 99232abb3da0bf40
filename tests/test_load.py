"""Load and faults against the real daemon: 64 concurrent clients, memory over 1000
generations, and clients that vanish at every stage. Figures printed with -s."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from qvld.errors import Busy, QvlError
from tests.conftest import TINY, Daemon, wait_for

pytestmark = pytest.mark.slow
IMAGE = (TINY / "images" / "small.png").read_bytes()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_sixty_four_clients_every_request_answered_once(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, args=["--set", "engine.infer_requests=2",
                                    "--set", "engine.max_sequences=2",
                                    "--set", "server.queue_max=8"]).start()
    outcomes: Counter[str] = Counter()
    health_ms: list[float] = []
    answered: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()
    per_client = 12

    def client_loop(n: int) -> None:
        with daemon.client(timeout=120) as client:
            for i in range(per_client):
                kind = ("generate", "health", "status")[i % 3]
                t0 = time.perf_counter()
                try:
                    if kind == "generate":
                        client.generate({"messages": [{"role": "user", "content": [
                            {"type": "image", "image": IMAGE},
                            {"type": "text", "text": f"client {n} request {i}"}]}],
                            "max_tokens": 6})
                    elif kind == "health":
                        assert client.health()["ready"]
                    else:
                        client.status()
                    outcome = f"{kind} ok"
                except Busy:
                    outcome = f"{kind} busy"
                except QvlError as exc:
                    outcome = f"{kind} {exc.code}"
                elapsed = time.perf_counter() - t0
                with lock:
                    outcomes[outcome] += 1
                    answered[(n, i)] += 1
                    if kind == "health":
                        health_ms.append(elapsed * 1000)

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(64)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    elapsed = time.perf_counter() - t0
    try:
        assert not any(t.is_alive() for t in threads), "deadlock: clients still waiting"
        assert len(answered) == 64 * per_client and set(answered.values()) == {1}
        assert set(outcomes) <= {"generate ok", "generate busy", "health ok", "status ok"}
        assert outcomes["generate busy"] > 0  # the queue bound was reached
        with daemon.client() as client:
            status = client.status()
        assert status["queue"]["running"] == 0 and status["queue"]["waiting"] == 0
        p99 = statistics.quantiles(health_ms, n=100)[98]
        print(f"64 clients x {per_client} requests in {elapsed:.1f} s: {dict(outcomes)}; "
              f"health p50 {statistics.median(health_ms):.1f} ms, p99 {p99:.1f} ms; "
              f"{len(answered)} requests, each answered once, 0 lost")
    finally:
        assert daemon.stop() == 0


def test_memory_is_flat_over_a_thousand_generations(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).start()
    assert daemon.proc is not None
    try:
        with daemon.client() as client:
            def generate(i: int) -> None:
                # A steady mix: plain questions, and chats that are closed after five turns
                # (a conversation's own history is data, not a leak).
                sid = f"chat-{i % 20}"
                if i % 100 < 20 and i >= 100:
                    client.close_session(sid)
                params: dict[str, Any] = {"messages": [{"role": "user", "content": [
                    {"type": "image", "image": IMAGE},
                    {"type": "text", "text": f"question {i % 50}"}]}], "max_tokens": 8}
                if i % 3 == 0:
                    params["session"] = sid
                client.generate(params)

            for i in range(100):
                generate(i)
            after_100 = rss_bytes(daemon.proc.pid)
            for i in range(100, 1000):
                generate(i)
            after_1000 = rss_bytes(daemon.proc.pid)
    finally:
        assert daemon.stop() == 0
    growth = (after_1000 - after_100) / 2**20
    print(f"RSS after 100 generations {after_100 / 2**20:.0f} MiB, after 1000 "
          f"{after_1000 / 2**20:.0f} MiB: growth {growth:+.1f} MiB")
    assert growth < 50


LONG = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}


def next_request_waits_briefly(daemon: Daemon) -> float:
    with daemon.client() as client:
        return float(client.generate({**LONG, "max_tokens": 2})["timings"]["queue_s"])


def test_client_leaving_while_queued_frees_its_place(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, args=["--set", "engine.infer_requests=1",
                                    "--set", "engine.max_sequences=1",
                                    "--set", "engine.max_new_tokens=4000"]).start()
    try:
        first = daemon.client()
        first.send({"id": 1, "op": "generate", "params": {**LONG, "max_tokens": 1200}})
        daemon.wait_queue(running=1)
        leaver = daemon.client()
        leaver.send({"id": 1, "op": "generate", "params": {**LONG, "max_tokens": 4000}})
        daemon.wait_queue(running=1, waiting=1)
        leaver.close()  # it was waiting in the queue
        t0 = time.perf_counter()
        reply = first.receive()
        first_left = time.perf_counter() - t0
        assert reply["ok"]
        queue_s = next_request_waits_briefly(daemon)
        first.close()
        # The next request did not wait for the 4000 tokens of the client that left.
        assert queue_s < 0.5, (queue_s, first_left)
        assert "outcome=cancelled" in daemon.log()
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_client_leaving_mid_generation_frees_the_worker(tmp_path: Path, stage: str) -> None:
    daemon = Daemon(tmp_path, args=["--set", "engine.infer_requests=1",
                                    "--set", "engine.max_sequences=1",
                                    "--set", "engine.max_new_tokens=4000",
                                    "--set", "engine.prefill_chunk=1"]).start()
    try:
        leaver = daemon.client()
        # "word " is 5 tokens of the tiny model's tokenizer: 3500 of its 4096 (3000 words,
        # 15000 tokens, were refused prompt_too_long before any prefill).
        params: dict[str, Any] = ({**LONG, "max_tokens": 2, "messages": [
            {"role": "user", "content": "word " * 700}]} if stage == "prefill"
            else {**LONG, "max_tokens": 4000, "stream": True})
        leaver.send({"id": 1, "op": "generate", "params": params})
        if stage == "prefill":  # 3500 prompt tokens one at a time: seconds of prefill
            daemon.wait_queue(running=1)
            assert "op=generate outcome=" not in daemon.log()  # unanswered: in prefill
        else:  # the first token streamed: it decodes
            assert leaver.receive()["event"] == "token"
        leaver.close()
        assert next_request_waits_briefly(daemon) < 0.5
        wait_for(lambda: "op=generate outcome=cancelled" in daemon.log(), 10,
                 "the leaver's generation to end cancelled", detail=daemon.log)
    finally:
        assert daemon.stop() == 0
