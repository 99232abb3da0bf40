"""Red-team round 3 against the real daemon's HTTP front: what request bodies can make it
hold or delay, and whether a keyed client is still served while keyless connections
churn. Each attack is watched from outside as in round 2 (``Watch``: the daemon's peak
RSS above its RSS before, and the socket's ``health`` probed every 20 ms on a connection
of its own). The daemon runs with the default HTTP limits (32 MiB bodies, 256
connections). Figures for RELIABILITY.md are printed (-s)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from qvld.http.keys import hash_key
from tests.conftest import Watch, proc_status, wait_for
from tests.test_http import HttpDaemon

pytestmark = pytest.mark.slow

MiB = 1 << 20
BODY_LIMIT = 32 * MiB  # http.max_body_bytes, the default
HI = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()


def nested_empty_arrays(size: int) -> bytes:
    """``[[],[],...,[]]`` of at most ``size`` bytes: valid JSON, three bytes a value."""
    n = (size - 2) // 3
    return b"[" + b"[]," * (n - 1) + b"[]]"


def head(length: int, extra: str = "") -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\n{extra}Content-Length: {length}\r\n\r\n"
            ).encode()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def post(port: int, body: bytes, timeout: float = 60) -> tuple[int, float]:
    """Send a whole body; (the status, seconds until it came)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(head(len(body)) + body)
        reply = conn.recv(4096)
    return status_of(reply), time.monotonic() - t0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("redteam3")).start()
    try:
        yield d
    finally:
        d.stop()


def still_serving(daemon: HttpDaemon) -> None:
    status, _, body = daemon.request("POST", "/v1/chat/completions", HI)
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


def test_a_body_of_nested_empty_arrays(daemon: HttpDaemon) -> None:
    bomb = nested_empty_arrays(BODY_LIMIT)
    with Watch(daemon) as watch:
        status, seconds = post(daemon.port, bomb)
    watch.report(f"one {len(bomb) / MiB:.0f} MiB body of [[],[],...]",
                 f"{status} in {seconds:.2f} s")
    assert status in (400, 413)
    assert watch.worst_s <= 1.0
    assert watch.peak_mib <= 200
    still_serving(daemon)


def test_four_such_bodies_at_once(daemon: HttpDaemon) -> None:
    bomb = nested_empty_arrays(BODY_LIMIT)
    with Watch(daemon) as watch, concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(daemon.port, bomb), range(4)))
    watch.report("four such bodies at once", ", ".join(
        f"{status} after {seconds:.1f} s" for status, seconds in answers))
    assert all(status in (400, 413, 429, 503) for status, _ in answers)
    assert max(seconds for _, seconds in answers) <= 15
    assert watch.worst_s <= 1.0
    still_serving(daemon)


def test_forty_connections_each_holding_most_of_a_body(daemon: HttpDaemon) -> None:
    """40 clients each send 31 MiB of a 32 MiB body and wait: what the daemon holds is
    bounded by http.max_pending_bytes, the refused ones get their answer at once (the
    rest of their bodies is read and dropped), and the memory goes when they do."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    part = memoryview(b"x" * (31 * MiB))
    conns: list[socket.socket] = []
    replies: dict[int, bytes] = {}
    done = threading.Barrier(41)

    def sender(index: int) -> None:
        conn = conns[index]
        try:
            conn.sendall(head(BODY_LIMIT))
            conn.sendall(part)
            conn.settimeout(0.5)  # an answer given at once is waiting by now
            replies[index] = conn.recv(4096)
        except OSError as exc:
            replies[index] = type(exc).__name__.encode()
        finally:
            done.wait()

    rss0 = proc_status(pid, "VmRSS")
    with Watch(daemon) as watch:
        for _ in range(40):
            conns.append(socket.create_connection(("127.0.0.1", daemon.port), timeout=60))
        threads = [threading.Thread(target=sender, args=(i,), daemon=True)
                   for i in range(40)]
        for thread in threads:
            thread.start()
        done.wait(timeout=120)
        held_mib = (proc_status(pid, "VmRSS") - rss0) / 1024
    statuses = sorted(status_of(r) for r in replies.values())
    refused = sum(s in (429, 503) for s in statuses)
    watch.report("40 connections holding 31 MiB of a 32 MiB body each",
                 f"{refused} answered 429/503 at once, {statuses.count(0)} waiting; "
                 f"RSS +{held_mib:.0f} MiB while they wait")
    for conn in conns:
        conn.close()
    assert watch.peak_mib <= 400
    assert watch.worst_s <= 1.0
    assert refused >= 36  # the total bound admits at most two 32 MiB bodies at a time
    # The memory goes with the connections.
    wait_for(lambda: proc_status(pid, "VmRSS") - rss0 <= 64 * 1024, 30,
             "the daemon's RSS back within 64 MiB of where it was",
             detail=lambda: f"+{(proc_status(pid, 'VmRSS') - rss0) / 1024:.0f} MiB")
    after_mib = (proc_status(pid, "VmRSS") - rss0) / 1024
    print(f"  after they closed: RSS +{after_mib:.0f} MiB")
    still_serving(daemon)


KEYS = [f"qvld-test-key-user{i}-0123456789" for i in range(4)]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpDaemon, str]]:
    """Four API-key users, and room for four whole bodies at once."""
    workdir = tmp_path_factory.mktemp("redteam3-keys")
    keys_file = workdir / "keys"
    keys_file.write_text("".join(f"user{i}:{hash_key(k)}\n" for i, k in enumerate(KEYS)))
    keys_file.chmod(0o600)
    d = HttpDaemon(workdir, args=["--set", f"http.api_keys_file={keys_file}",
                                  "--set", f"http.max_pending_bytes={4 * BODY_LIMIT}"]
                   ).start()
    try:
        yield d, KEYS[0]
    finally:
        d.stop()


def test_four_users_bodies_at_once_are_all_walked_off_the_event_loop(
        keyed: tuple[HttpDaemon, str]) -> None:
    """Each user's share holds one whole body, and the total four: all four bombs are
    read, walked and refused (400), none is turned away for room."""
    daemon, _ = keyed
    bomb = nested_empty_arrays(BODY_LIMIT)

    def send(key: str) -> tuple[int, float]:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as conn:
            conn.sendall(head(len(bomb), f"Authorization: Bearer {key}\r\n") + bomb)
            reply = conn.recv(4096)
        return status_of(reply), time.monotonic() - t0

    with Watch(daemon) as watch, concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, KEYS))
    watch.report("four users' such bodies at once", ", ".join(
        f"{status} after {seconds:.1f} s" for status, seconds in answers))
    assert [status for status, _ in answers] == [400] * 4
    assert max(seconds for _, seconds in answers) <= 15
    assert watch.worst_s <= 1.0


def test_keyless_connections_churning_leave_a_keyed_client_served(
        keyed: tuple[HttpDaemon, str]) -> None:
    daemon, key = keyed
    stop = threading.Event()
    churned = [0]

    def churn() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", daemon.port), timeout=5) as c:
                    c.sendall(head(len(HI)) + HI)  # no key; dropped without reading
            except OSError:
                pass
            churned[0] += 1

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(128)]
    for thread in threads:
        thread.start()
    served, seconds = 0, []
    try:
        for _ in range(10):
            conn = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
            t0 = time.monotonic()
            try:
                conn.request("POST", "/v1/chat/completions", HI, {
                    "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
                served += conn.getresponse().status == 200
            except (OSError, http.client.HTTPException):
                pass
            finally:
                conn.close()
            seconds.append(time.monotonic() - t0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    print(f"keyed client beside 128 churning keyless connections ({churned[0]} opened): "
          f"{served} of 10 served, slowest {max(seconds):.2f} s")
    assert served >= 9



def test_compressed_bodies_are_refused_unread(daemon: HttpDaemon) -> None:
    """Round 4: 510 KB of gzip announced with its compressed Content-Length inflated to
    512 MiB past every body bound (+1.5 GiB RSS, 15.5 s). Now 415 before a byte is read:
    eight such bodies at once, as sent by a user who would be refused anyway."""
    from tests.test_http_hostile import gzip_bomb

    bomb = gzip_bomb(512 * MiB)
    assert len(bomb) < 600 << 10

    def send() -> tuple[int, float]:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=60) as conn:
            conn.sendall(head(len(bomb), "Content-Encoding: gzip\r\n"
                              "Authorization: Bearer not-a-key\r\n") + bomb)
            reply = conn.recv(4096)
        return status_of(reply), time.monotonic() - t0

    with Watch(daemon) as watch, concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: send(), range(8)))
    watch.report("8 x 510 KB gzip bodies (512 MiB inflated each)",
                 f"{[s for s, _ in results]} in {max(t for _, t in results):.2f} s")
    assert [status for status, _ in results] == [415] * 8
    assert watch.peak_mib < 100 and watch.worst_s < 1.0
    still_serving(daemon)


def test_request_heads_alone_hold_no_share_of_the_body_budget(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Round 4: two users each announcing a 32 MiB body and sending nothing held the
    default http.max_pending_bytes (64 MiB) whole: a third user got 0/136 answers (503)
    over 70 s. Bytes are reserved as they arrive now: the third is served."""
    workdir = tmp_path_factory.mktemp("heads")
    keys_file = workdir / "keys"
    keys_file.write_text("".join(f"user{i}:{hash_key(k)}\n" for i, k in enumerate(KEYS)))
    keys_file.chmod(0o600)
    d = HttpDaemon(workdir, args=["--set", f"http.api_keys_file={keys_file}"]).start()
    heads = []
    try:
        for key in KEYS[:2]:  # each announces a whole body and sends nothing more
            for _ in range(4):
                conn = socket.create_connection(("127.0.0.1", d.port), timeout=30)
                conn.sendall(head(BODY_LIMIT, f"Authorization: Bearer {key}\r\n"))
                heads.append(conn)
        statuses = []
        t0 = time.monotonic()
        for _ in range(20):
            status, _, _ = d.request("POST", "/v1/chat/completions", HI,
                                        {"Authorization": f"Bearer {KEYS[2]}"})
            statuses.append(status)
        took = time.monotonic() - t0
        print(f"8 heads announcing 32 MiB each (two users): a third user's 20 requests "
              f"{statuses.count(200)} x 200 in {took:.1f} s")
        assert statuses == [200] * 20
    finally:
        for conn in heads:
            conn.close()
        d.stop()
