"""The hostile-input catalogue, on HTTP: every item gets a typed 4xx (or is cut off in
bounded time), and the daemon goes on serving everyone after each."""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import os
import resource
import selectors
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import NOBODY, wait_for
from tests.test_http import RECEIPT, HttpDaemon

READ_TIMEOUT_S = 2
MAX_CONNECTIONS = 64
# The receipt cut off inside its pixel data.
CORRUPT_URL = "data:image/png;base64," + base64.b64encode(RECEIPT.read_bytes()[:3000]).decode()
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDaemon]:
    d = HttpDaemon(tmp_path_factory.mktemp("hostile"), args=[
        "--set", f"http.read_timeout_s={READ_TIMEOUT_S}",
        "--set", f"http.max_connections={MAX_CONNECTIONS}",
        "--set", "http.max_body_bytes=1048576", "--set", "http.max_unsent_events=16",
        "--set", "http.send_buffer_bytes=4096"]).start()
    try:
        yield d
    finally:
        d.stop()


def still_serving(daemon: HttpDaemon) -> None:
    status, _, body = daemon.request("POST", "/v1/chat/completions", json.dumps(HI).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body
    assert daemon.proc is not None and daemon.proc.poll() is None


def raw(daemon: HttpDaemon, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` as it is; everything the daemon answers until it closes."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=timeout) as conn:
        conn.sendall(data)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
        return out


def post(body: bytes, headers: str = "", path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\n".encode()
            + b"Host: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n" + headers.encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def error_of(reply: bytes) -> dict[str, str]:
    return dict(json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"])


@pytest.mark.parametrize("body, code", [
    (b"{", "bad_request"), (b"[]", "bad_request"), (b"\xff\xfe{}", "bad_request"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "bad_request"),
    (b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "bad_request"),
    (b"[" + b"[1]," * 70_000 + b"[1]]", "bad_request"),
    (b"[" * 100_000 + b"]" * 100_000, "bad_request"),
    (json.dumps({**HI, "unknown_field": 1}).encode(), "bad_request"),
    (b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, '
     b'"max_tokens": 3}', "bad_request"),  # a key twice: which one counts?
    (json.dumps({**HI, "max_tokens": 10**12}).encode(), "bad_request"),
    (json.dumps({**HI, "temperature": 1e400}).encode().replace(b"Infinity", b"1e400"),
     "bad_request"),
    (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest"}}]}]}
     ).encode(), "bad_request"),
    (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": CORRUPT_URL}}]}]}
     ).encode(), "image_invalid"),
])
def test_bad_bodies_get_typed_400s(daemon: HttpDaemon, body: bytes, code: str) -> None:
    reply = raw(daemon, post(body))
    assert status_of(reply) == 400, reply[:300]
    assert error_of(reply)["code"] == code
    still_serving(daemon)


ASK = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


def with_content(*blocks: dict[str, Any]) -> bytes:
    return json.dumps({**ASK, "messages": [{"role": "user", "content": list(blocks)}]}
                      ).encode()


@pytest.mark.parametrize("body", [
    b"{", b"[]", b"\xff\xfe{}", b"[" + b"[1]," * 70_000 + b"[1]]",
    b"[" * 100_000 + b"]" * 100_000,
    json.dumps({**ASK, "unknown_field": 1}).encode(),
    b'{"model": "tiny", "max_tokens": 2, "max_tokens": 3, "messages": []}',
    json.dumps({**ASK, "max_tokens": 10**12}).encode(),
    json.dumps({**ASK, "temperature": 1e400}).encode().replace(b"Infinity", b"1e400"),
    json.dumps({**ASK, "messages": [{"role": "user", "content": "\ud800"}]}).encode(),
    with_content({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": "bm90IGFuIGltYWdl"}}),
    with_content({"type": "image", "source": {"type": "base64", "media_type": "image/svg",
                                              "data": "PHN2Zz4="}}),
    with_content({"type": "image", "source": {"type": "url",
                                              "url": "http://169.254.169.254/latest"}}),
    with_content({"type": "tool_use", "id": "x", "name": "add", "input": {}}),
    with_content({"type": "tool_result", "tool_use_id": 7, "content": "5"}),
    json.dumps({**ASK, "tools": [{"input_schema": {"type": "object"}}]}).encode(),
    json.dumps({**ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
               ).encode(),
    json.dumps({**ASK, "tool_choice": {"type": "tool"}}).encode(),
    json.dumps({**ASK, "thinking": {"type": "enabled", "budget_tokens": 1024}}).encode(),
    json.dumps({**ASK, "output_config": {"format": {"type": "json_schema",
                                                    "schema": {"type": 7}}}}).encode(),
])
def test_bad_messages_bodies_get_the_anthropic_apis_400s(daemon: HttpDaemon,
                                                         body: bytes) -> None:
    """The Messages API front (#47): the same body bounds and typed refusals as chat
    completions, in its own error shape; nothing else breaks."""
    reply = raw(daemon, post(body, path="/v1/messages"))
    assert status_of(reply) == 400, reply[:300]
    answer = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"]
    still_serving(daemon)


CHAT = {"model": "tiny", "stream": False, "options": {"num_predict": 2},
        "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("body", [
    b"{", b"[]", b"\xff\xfe{}", b"[" + b"[1]," * 70_000 + b"[1]]",
    json.dumps({**CHAT, "messags": []}).encode(),  # a misspelling: refused
    json.dumps({**CHAT, "options": {"num_predict": 10**12}}).encode(),
    json.dumps({**CHAT, "options": {"temperature": 1e400}}).encode().replace(
        b"Infinity", b"1e400"),
    json.dumps({**CHAT, "options": {"top_kk": 3}}).encode(),
    json.dumps({**CHAT, "messages": "Hi"}).encode(),
    json.dumps({**CHAT, "messages": [{"role": "robot", "content": "Hi"}]}).encode(),
    json.dumps({**CHAT, "messages": [{"role": "user", "content": "Hi",
                                      "images": ["%%%"]}]}).encode(),
    json.dumps({**CHAT, "format": {"type": 7}}).encode(),
    json.dumps({**CHAT, "tools": [{"type": "function"}]}).encode(),
    json.dumps({**CHAT, "think": True}).encode(),
])
def test_bad_ollama_bodies_get_400s_in_its_shape(daemon: HttpDaemon, body: bytes) -> None:
    """The Ollama front (#47): the same bounds and typed refusals, as {"error": ...}."""
    reply = raw(daemon, post(body, path="/api/chat"))
    assert status_of(reply) == 400, reply[:300]
    answer = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert set(answer) == {"error"} and answer["error"]
    still_serving(daemon)


RESPOND = {"model": "tiny", "max_output_tokens": 2, "input": "Hi"}


@pytest.mark.parametrize("body", [
    b"{", b"[]", b"[" * 100_000 + b"]" * 100_000,
    json.dumps({**RESPOND, "inptu": "Hi"}).encode(),
    json.dumps({**RESPOND, "max_output_tokens": 10**12}).encode(),
    json.dumps({**RESPOND, "input": []}).encode(),
    json.dumps({**RESPOND, "input": [{"type": "computer_call"}]}).encode(),
    json.dumps({**RESPOND, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}]}]}
               ).encode(),
    json.dumps({**RESPOND, "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]}).encode(),
    json.dumps({**RESPOND, "input": [{"type": "function_call_output", "output": "5"}]}
               ).encode(),
    json.dumps({**RESPOND, "tools": [{"type": "web_search"}]}).encode(),
    json.dumps({**RESPOND, "text": {"format": {"type": "json_schema"}}}).encode(),
    json.dumps({**RESPOND, "previous_response_id": "resp_nobody"}).encode(),
    json.dumps({**RESPOND, "background": True}).encode(),
])
def test_bad_responses_bodies_get_typed_400s(daemon: HttpDaemon, body: bytes) -> None:
    """The Responses front (#47): the same bounds and typed refusals as chat
    completions, in OpenAI's shape."""
    reply = raw(daemon, post(body, path="/v1/responses"))
    assert status_of(reply) == 400, reply[:300]
    assert error_of(reply)["code"] in ("bad_request", "image_invalid")
    still_serving(daemon)


@pytest.mark.parametrize("body", [
    b"{", b'{"prompt": 7}', b'{"prompt": ["a", "b"]}', b'{"prompt": [1, 2, 3]}',
    b'{"prompt": ""}', b'{"prompt": "Hi", "echo": true}', b'{"prompt": "Hi", "best_of": 3}',
    b'{"prompt": "Hi", "max_tokens": 1000000000000}', b'{"prompt": "Hi", "promt": 1}',
    b'{"prompt": "<|vision_start|><|image_pad|><|vision_end|>"}',
    b'{"prompt": "Hi", "logit_bias": {"-1": 5}}', b'{"prompt": "Hi", "n": 99}',
])
def test_bad_text_completions_get_typed_400s(daemon: HttpDaemon, body: bytes) -> None:
    """Text completions (#47): a raw prompt gets the same typed refusals."""
    reply = raw(daemon, post(body, path="/v1/completions"))
    assert status_of(reply) == 400, reply[:300]
    assert error_of(reply)["code"] == "bad_request"
    still_serving(daemon)


def test_a_messages_body_past_the_limit_gets_413_in_the_apis_shape(daemon: HttpDaemon
                                                                   ) -> None:
    big = with_content({"type": "text", "text": "x" * (2 << 20)})
    reply = raw(daemon, post(big, path="/v1/messages"))
    assert status_of(reply) == 413
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == \
        "request_too_large"
    still_serving(daemon)


def test_an_announced_huge_body_gets_413_and_the_client_reads_it(daemon: HttpDaemon) -> None:
    """413 at once, before the body is read; the rest is read and dropped (nothing held),
    so a client that goes on sending the whole body reads the answer, not a reset."""
    announced = 100 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % announced)
        block = b"{" * 65536
        for _ in range(announced // len(block)):
            conn.sendall(block)
        reply = conn.recv(65536)
        assert status_of(reply) == 413 and error_of(reply)["code"] == "frame_too_large"
        assert b"Connection: close" in reply.split(b"\r\n\r\n")[0]
        assert conn.recv(65536) == b""  # then closed, not read as another request
    still_serving(daemon)


def test_a_refused_body_that_never_ends_is_cut_off(daemon: HttpDaemon) -> None:
    """Dropping a refused body's rest lasts at most http.read_timeout_s."""
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: 1000000000000\r\n\r\n")
        t0 = time.monotonic()
        with pytest.raises((ConnectionError, BrokenPipeError)):
            while time.monotonic() - t0 < 30:
                conn.sendall(b"x" * 65536)
        assert time.monotonic() - t0 <= READ_TIMEOUT_S + 5
    still_serving(daemon)


def gzip_bomb(inflated: int) -> bytes:
    """``inflated`` bytes of JSON whitespace, gzip'd to about a thousandth of that."""
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip header and trailer
    block = b" " * (1 << 20)
    return b"".join([*(packer.compress(block) for _ in range(inflated // len(block))),
                     packer.flush()])


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP, identity"])
def test_a_compressed_body_is_refused_before_it_is_read(daemon: HttpDaemon,
                                                        encoding: str) -> None:
    """415 naming the encoding, whatever the body: nothing is inflated, so no bound can be
    passed (a 64 KiB body that inflates to 64 MiB, here; the limit is 1 MiB)."""
    bomb = gzip_bomb(64 << 20)
    assert len(bomb) < 128 << 10
    t0 = time.monotonic()
    reply = raw(daemon, post(bomb, f"Content-Encoding: {encoding}\r\n"))
    assert time.monotonic() - t0 < 5
    assert status_of(reply) == 415, reply[:300]
    error = error_of(reply)
    assert error["code"] == "bad_request" and encoding.split(",")[0] in error["message"]
    assert error["type"] == "invalid_request_error"
    still_serving(daemon)


def test_a_chunked_compressed_body_and_identity(daemon: HttpDaemon) -> None:
    bomb = gzip_bomb(8 << 20)
    chunked = b"%x\r\n" % len(bomb) + bomb + b"\r\n0\r\n\r\n"
    reply = raw(daemon, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                b"Connection: close\r\nContent-Encoding: gzip\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + chunked)
    assert status_of(reply) == 415
    # Identity is no encoding: served.
    reply = raw(daemon, post(json.dumps(HI).encode(), "Content-Encoding: identity\r\n"))
    assert status_of(reply) == 200, reply[:300]


def test_a_chunked_body_past_the_limit_gets_413(daemon: HttpDaemon) -> None:
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(40)) + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):  # closed as soon as the limit passed
            conn.sendall(body)
        reply = conn.recv(65536)
    assert status_of(reply) == 413
    still_serving(daemon)


def test_slowloris_head_and_body_are_cut_off_in_bounded_time(daemon: HttpDaemon) -> None:
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as head, \
            socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as body:
        t0 = time.monotonic()
        head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")
        body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\":")
        assert head.recv(65536) == b""  # closed, nothing answered
        assert time.monotonic() - t0 < READ_TIMEOUT_S + 3
        reply = body.recv(65536)
        assert status_of(reply) == 408, reply[:200]
        assert time.monotonic() - t0 < READ_TIMEOUT_S + 3
    still_serving(daemon)


@pytest.mark.parametrize("value", ["a b", "../../etc/passwd", "x" * 129, "sé", "a;b"])
def test_session_header_injection_is_refused(daemon: HttpDaemon, value: str) -> None:
    reply = raw(daemon, post(json.dumps(HI).encode(),
                             f"X-Qvld-Session: {value}\r\n".replace("é", "\\u00e9")))
    assert status_of(reply) == 400 and error_of(reply)["param"] == "X-Qvld-Session"
    still_serving(daemon)


def test_crlf_in_a_header_never_becomes_a_header(daemon: HttpDaemon) -> None:
    # A bare CR inside a header value: aiohttp's parser refuses the request.
    reply = raw(daemon, post(json.dumps(HI).encode(), "X-Qvld-Session: a\rSet-Cookie: x\r\n"))
    assert status_of(reply) == 400 and b"Set-Cookie" not in reply.split(b"\r\n\r\n")[0]
    still_serving(daemon)


def test_a_client_that_stops_reading_its_stream_is_cut_off(daemon: HttpDaemon) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "Go on"}], "stream": True,
                       "max_tokens": 500, "ignore_eos": True}).encode()
    cut_before = daemon.log().count("is not reading its stream")
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills after a few events
    try:
        conn.connect(("127.0.0.1", daemon.port))
        conn.sendall(post(body))  # and never reads
        wait_for(lambda: daemon.log().count("is not reading its stream") > cut_before
                 and "outcome=cancelled" in daemon.log().split("is not reading")[-1], 60,
                 "the daemon to cut the stalled reader off", detail=daemon.log)
    finally:
        conn.close()
    line = daemon.log().split("is not reading its stream")[-1]
    generated = int(line.split(" generated_tokens=")[1].split()[0])
    assert generated < 500, line
    still_serving(daemon)


def test_methods_and_paths_get_405_and_404_in_openais_shape(daemon: HttpDaemon) -> None:
    status, headers, body = daemon.request("GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert "POST" in headers.get("Allow", "")
    status, _, body = daemon.request("GET", "/v1/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, _, body = daemon.request("GET", "/v1/nothing")
    assert status == 404 and body["error"]["type"] == "not_found_error"


def non_loopback_address() -> str | None:
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False)
    return next((a for a in out.stdout.split() if "." in a and not a.startswith("127.")),
                None)


def test_without_keys_only_loopback_clients_are_served(tmp_path: Path) -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    d = HttpDaemon(tmp_path, args=["--set", "http.listen=0.0.0.0:0"])
    d.argv[d.argv.index("http.listen=0.0.0.0:0")] = f"http.listen=0.0.0.0:{d.port}"
    d.start()
    try:
        with socket.create_connection((address, d.port), timeout=10,
                                      source_address=(address, 0)) as conn:
            conn.sendall(post(json.dumps(HI).encode()))
            reply = conn.recv(65536)
        assert status_of(reply) == 403 and error_of(reply)["code"] == "forbidden"
        assert "callers from other hosts need an API key" in error_of(reply)["message"]
        still_serving(d)  # on 127.0.0.1
        assert "callers are the local users the kernel says they are" in d.log()
    finally:
        d.stop()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.slow
def test_ten_thousand_connections(daemon: HttpDaemon) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 12000), hard))
    if min(hard, 12000) < 10_500:
        pytest.fail(f"the open-file limit ({hard}) is below what this test needs")
    assert daemon.proc is not None
    fds_before = open_fds(daemon.proc.pid)
    conns: list[socket.socket] = []
    # The kernel queues at most net.core.somaxconn handshakes the daemon has not yet
    # accepted; past that it drops the client's last ACK and, after its SYN-ACK retries,
    # forgets a connection its client believes open (a hang the kernel makes, whatever
    # the daemon does; on a loaded machine CI saw 198 of them). So the flood keeps at
    # most half that queue unanswered at any moment: 10 000 connections, as fast as the
    # daemon takes them.
    window = min(int(Path("/proc/sys/net/core/somaxconn").read_text()), 4096) // 2
    try:
        selector = selectors.DefaultSelector()
        # Past the limit, connections are answered 429 and closed at once, unread.
        replies: collections.Counter[str] = collections.Counter()

        def take_replies(timeout: float) -> None:
            for key, _ in selector.select(timeout=timeout):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(4096)
                except OSError as exc:
                    data = type(exc).__name__.encode()
                replies[data[:12].decode(errors="replace")] += 1
                selector.unregister(sock)

        t0 = time.monotonic()
        deadline = t0 + 120
        while len(conns) < 10_000 and time.monotonic() < deadline:
            if len(conns) - replies.total() >= window:
                take_replies(timeout=1)
                continue
            conn = socket.socket()
            conn.setblocking(False)
            conn.connect_ex(("127.0.0.1", daemon.port))
            conns.append(conn)
            selector.register(conn, selectors.EVENT_READ)
        while replies.total() < len(conns) and time.monotonic() < deadline:
            take_replies(timeout=1)
        elapsed = time.monotonic() - t0
        # Each was answered 429 at once, or held (a slot of the limit) until the idle
        # timer closed it (the empty reply); none was reset or left hanging. A slot holds
        # one idle connection per read timeout, so at most this many were held:
        held = MAX_CONNECTIONS * (elapsed / READ_TIMEOUT_S + 1)
        assert set(replies) <= {"HTTP/1.1 429", ""} and replies.total() == 10_000, (
            replies, f"{len(conns)} opened", f"{elapsed:.1f} s",
            f"{open_fds(daemon.proc.pid)} descriptors open")
        assert replies[""] <= held, (replies, elapsed)
        print(f"10 000 connections: {dict(replies)} within {elapsed:.1f} s")
        # The daemon holds no more than its limit; the socket side serves meanwhile.
        pid = daemon.proc.pid
        wait_for(lambda: open_fds(pid) <= fds_before + MAX_CONNECTIONS + 16, 30,
                 "the daemon to hold at most http.max_connections connections",
                 detail=lambda: f"{open_fds(pid)} descriptors open")
        with daemon.client() as client:
            assert client.health()["ready"]
    finally:
        for conn in conns:
            conn.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    wait_for(lambda: open_fds(daemon.proc.pid) <= fds_before + 2, 30,  # type: ignore[union-attr]
             "the daemon to close the connections")
    still_serving(daemon)


HOLD_CONNECTIONS = """
import socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
extra = socket.create_connection(("127.0.0.1", port))
extra.settimeout(10)
print(extra.recv(12).decode(), flush=True)  # past its share: answered at once
sys.stdin.read()  # hold them until told
"""


@pytest.mark.slow  # a daemon of its own: the default tier stays under 5 minutes
def test_one_users_idle_connections_do_not_shut_out_another(tmp_path: Path) -> None:
    """#46 (round 3's last finding): connections opened and never used held every one
    of http.max_connections before anyone was authenticated (a keyed client 0/25
    served). Each local user (or remote address) is held to its fair share once the
    limit is reached: uid 65534 opens the limit's worth and its next one is a 429; root,
    holding none, is served."""
    import shutil

    daemon = HttpDaemon(tmp_path, args=["--set", "http.max_connections=16",
                                        "--set", "http.read_timeout_s=60"]).start()
    python = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
    hog = subprocess.Popen([python, "-c", HOLD_CONNECTIONS, str(daemon.port), "16"],
                           user=NOBODY, group=NOBODY, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, cwd="/")
    try:
        assert hog.stdout is not None
        assert hog.stdout.readline().decode().strip() == "HTTP/1.1 429"
        still_serving(daemon)  # root: its share of a full house
    finally:
        hog.communicate(b"", timeout=30)
        daemon.stop()
