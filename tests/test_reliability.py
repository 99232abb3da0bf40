"""Hostile input against the real daemon: every case gets its typed error, and the next
good request is answered normally. Figures for RELIABILITY.md are printed (-s)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from PIL import Image

from qvld import protocol
from qvld.errors import QvlError
from tests.conftest import TINY, Daemon, wait_for

MAX_FRAME = 1 << 20


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("hostile"), args=[
        "--set", f"server.max_frame_bytes={MAX_FRAME}", "--set", "server.read_timeout_s=1",
        "--set", "server.max_connections=64", "--set", "engine.max_context_tokens=512"])
    daemon.start()
    yield daemon
    assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon died"
    assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


def connect(daemon: Daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(daemon.socket))
    return sock


def read_reply(sock: socket.socket) -> dict[str, Any] | None:
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        if not chunk:
            return None
        header += chunk
    length = struct.unpack(">I", header)[0]
    data = b""
    while len(data) < length:
        chunk = sock.recv(length - len(data))
        if not chunk:
            return None
        data += chunk
    return dict(msgpack.unpackb(data, raw=False))


def still_good(daemon: Daemon) -> None:
    with daemon.client() as client:
        result = client.generate({"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2})
        assert len(result["token_ids"]) == 2


def image(fmt: str, size: tuple[int, int] = (64, 48), mode: str = "RGB", **kw: Any) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128 if mode in ("L", "I;16") else (10, 200, 30)).save(buf, fmt, **kw)
    return buf.getvalue()


def bomb_png() -> bytes:
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100000, 100000, 8,
                                                            2, 0, 0, 0)) + chunk(b"IEND", b"")


def gif_animated() -> bytes:
    frames = [Image.new("RGB", (40, 30), c) for c in ((250, 0, 0), (0, 0, 250))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    return buf.getvalue()


def png16() -> bytes:
    buf = io.BytesIO()
    Image.fromarray((np.arange(4096).reshape(64, 64) * 16).astype(np.uint16)).save(buf, "PNG")
    return buf.getvalue()


# -- frames -----------------------------------------------------------------------------

RAW_CASES: list[tuple[str, bytes, str, bool]] = [
    # name, bytes sent, expected code, whether the daemon closes the line
    ("length_prefix_4GiB", struct.pack(">I", 0xFFFFFFFF), "frame_too_large", True),
    ("max_frame_plus_one", struct.pack(">I", MAX_FRAME + 1), "frame_too_large", True),
    ("not_msgpack", protocol.HEADER.pack(3) + b"\xc1\xc1\xc1", "bad_request", False),
    ("deep_nesting", protocol.HEADER.pack(200001) + b"\x91" * 200000 + b"\xc0",
     "bad_request", False),
    ("huge_array_header", protocol.HEADER.pack(5) + b"\xdd\xff\xff\xff\xff", "bad_request",
     False),
    ("huge_map_header", protocol.HEADER.pack(5) + b"\xdf\xff\xff\xff\xff", "bad_request",
     False),
    ("huge_string_header", protocol.HEADER.pack(5) + b"\xdb\xff\xff\xff\xff", "bad_request",
     False),
    ("non_map_request", protocol.pack([1, "generate"])[0:0] + protocol.HEADER.pack(3)
     + msgpack.packb([1, 2]), "bad_request", False),
    ("invalid_utf8", protocol.HEADER.pack(4) + b"\xa3\xff\xfe\xfd", "bad_request", False),
]


@pytest.mark.parametrize(("name", "data", "code", "closes"), RAW_CASES,
                         ids=[c[0] for c in RAW_CASES])
def test_hostile_frames(hostile: Daemon, name: str, data: bytes, code: str,
                        closes: bool) -> None:
    sock = connect(hostile)
    sock.sendall(data)
    reply = read_reply(sock)
    assert reply is not None and reply["id"] is None
    assert reply["error"]["code"] == code
    if closes:
        assert sock.recv(1) == b""
    sock.close()
    still_good(hostile)


@pytest.mark.slow  # a load test: about 25 s here
def test_a_hundred_thousand_tiny_messages(hostile: Daemon) -> None:
    sock = connect(hostile)
    count = 100_000
    replies: dict[int, int] = {}

    def reader() -> None:
        for _ in range(count):
            reply = read_reply(sock)
            assert reply is not None
            replies[reply["id"]] = replies.get(reply["id"], 0) + 1

    thread = threading.Thread(target=reader)
    thread.start()
    t0 = time.perf_counter()
    batch = b"".join(protocol.pack({"id": i, "op": "health"}) for i in range(count))
    sock.sendall(batch)
    thread.join(120)
    elapsed = time.perf_counter() - t0
    sock.close()
    assert len(replies) == count and set(replies.values()) == {1}  # each exactly once
    print(f"100000 health frames on one connection: {elapsed:.1f} s "
          f"({count / elapsed:.0f}/s), all answered once")
    still_good(hostile)


def test_slowloris_and_a_thousand_idle_connections(hostile: Daemon) -> None:
    slow = connect(hostile)
    slow.sendall(protocol.HEADER.pack(100) + b"x")
    idle = []
    refused = 0
    for _ in range(1000):
        sock = connect(hostile)
        idle.append(sock)
    # Beyond max_connections (64) the daemon answers busy and closes; the rest idle.
    for sock in idle:
        # One refused at once may be closed before this reaches it; its busy reply
        # still waits to be read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(protocol.pack({"id": 1, "op": "health"}))
    for sock in idle:
        reply = read_reply(sock)
        if reply is not None and not reply.get("ok"):
            assert reply["error"]["code"] == "busy"
            refused += 1
    assert refused >= 1000 - 64
    assert slow.recv(1) == b""  # the half frame timed out
    for sock in idle:
        sock.close()
    slow.close()
    # Served again once the daemon has noticed enough of the 1000 closes.
    wait_for(hostile.serves_a_new_connection, 30, "a connection served after the closes",
             detail=hostile.log)
    still_good(hostile)
    print(f"1000 idle connections: {1000 - refused} held, {refused} refused busy")


# -- requests ---------------------------------------------------------------------------

CLIP = (TINY / "images" / "clip.mp4").read_bytes()


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name,
                                             "parameters": parameters or {"type": "object"}}}


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What?"}]}]


REQUEST_CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("missing_messages", {}, "bad_request"),
    ("messages_wrong_type", {"messages": "hi"}, "bad_request"),
    ("unknown_param", {"messages": user(), "temprature": 0.5}, "bad_request"),
    ("image_0_bytes", {"messages": user({"type": "image", "image": b""})}, "image_invalid"),
    ("not_an_image", {"messages": user({"type": "image", "image": b"GIF89a no"})},
     "image_invalid"),
    ("truncated_png", {"messages": user({"type": "image", "image": image("PNG")[:60]})},
     "image_invalid"),
    ("truncated_jpeg", {"messages": user({"type": "image", "image": image("JPEG")[:200]})},
     "image_invalid"),
    ("decompression_bomb", {"messages": user({"type": "image", "image": bomb_png()})},
     "image_too_large"),
    ("image_1x1", {"messages": user({"type": "image", "image": image("PNG", (1, 1))}),
                   "max_tokens": 1}, None),
    ("aspect_1_to_300", {"messages": user({"type": "image", "image": image("PNG", (1, 300))})},
     "image_invalid"),
    ("too_many_images", {"messages": user(*[{"type": "image", "image": image("PNG")}] * 9)},
     "bad_request"),
    ("animated_gif", {"messages": user({"type": "image", "image": gif_animated()}),
                      "max_tokens": 1}, None),
    ("cmyk_jpeg", {"messages": user({"type": "image", "image": image("JPEG", mode="CMYK")}),
                   "max_tokens": 1}, None),
    ("png_16bit", {"messages": user({"type": "image", "image": png16()}), "max_tokens": 1},
     None),
    ("image_as_a_path", {"messages": user({"type": "image", "image": "/etc/shadow"})},
     "bad_request"),
    ("prompt_beyond_context", {"messages": [{"role": "user", "content": "word " * 2000}]},
     "prompt_too_long"),
    ("max_tokens_0", {"messages": user(), "max_tokens": 0}, "bad_request"),
    ("max_tokens_negative", {"messages": user(), "max_tokens": -5}, "bad_request"),
    ("max_tokens_huge", {"messages": user(), "max_tokens": 10**12}, "bad_request"),
    ("max_tokens_float", {"messages": user(), "max_tokens": 2.5}, "bad_request"),
    ("temperature_nan", {"messages": user(), "temperature": float("nan")}, "bad_request"),
    ("temperature_inf", {"messages": user(), "temperature": float("inf")}, "bad_request"),
    ("top_p_nan", {"messages": user(), "top_p": float("nan")}, "bad_request"),
    ("stop_10k_strings", {"messages": user(), "stop": ["x"] * 10_000}, "bad_request"),
    ("stop_too_long", {"messages": user(), "stop": ["x" * 300]}, "bad_request"),
    ("session_1MB", {"messages": user(), "session": "s" * 1_000_000}, "bad_request"),
    ("frame_over_the_limit", {"messages": user(), "session": "s" * (1 << 20)},
     "frame_too_large"),
    ("session_bad_chars", {"messages": user(), "session": "../../etc"}, "bad_request"),
    ("seed_huge", {"messages": user(), "seed": 2**64 - 1}, "bad_request"),
    ("role_unknown", {"messages": [{"role": "function", "content": "x"}]}, "bad_request"),
    ("deadline_negative", {"messages": user(), "deadline_s": -1}, "bad_request"),
    # Tools, choices, template variables and videos (2026-12-03).
    ("tools_not_a_list", {"messages": user(), "tools": {"a": 1}}, "bad_request"),
    ("tools_129", {"messages": user(), "tools": [tool(f"f{i}") for i in range(129)]},
     "bad_request"),
    ("tool_schema_200KB", {"messages": user(), "tools": [tool("f", {
        "type": "object", "description": "x" * 200_000})]}, "bad_request"),
    ("tool_choice_unknown", {"messages": user(), "tools": [tool("f")],
                             "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "bad_request"),
    ("tool_call_object_beyond_context", {"messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "f", "arguments": {f"k{i}": "word " * 200 for i in range(500)}}}]},
        *user()]}, "prompt_too_long"),
    ("n_17", {"messages": user(), "n": 17}, "bad_request"),
    ("template_kwargs_messages", {"messages": user(),
                                  "chat_template_kwargs": {"messages": []}}, "bad_request"),
    ("template_kwargs_8KB", {"messages": user(),
                             "chat_template_kwargs": {"x": "y" * 8192}}, "bad_request"),
    ("video_garbage", {"messages": user({"type": "video", "video": b"\x00" * 5000})},
     "video_invalid"),
    ("video_truncated", {"messages": user({"type": "video", "video": CLIP[:len(CLIP) // 2]})},
     "video_invalid"),
    ("video_frames_not_pictures", {"messages": user({"type": "video",
                                                     "frames": [b"no", b"no"]})},
     "image_invalid"),
    ("video_frames_769", {"messages": user({"type": "video", "frames": [b"x"] * 769})},
     "bad_request"),
    ("videos_5", {"messages": user(*[{"type": "video", "video": CLIP}] * 5)}, "bad_request"),
    # No answer in the format fits max_tokens (2026-12-03): a date is 10 characters.
    ("format_longer_than_max_tokens", {"messages": user(), "max_tokens": 9, "response_format": {
        "type": "regex", "pattern": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"}}, "bad_request"),
]


@pytest.mark.parametrize(("name", "params", "code"), REQUEST_CASES,
                         ids=[c[0] for c in REQUEST_CASES])
def test_hostile_requests(hostile: Daemon, name: str, params: dict[str, Any],
                          code: str | None) -> None:
    with hostile.client() as client:
        if code is None:
            assert client.generate(params)["finish_reason"] in ("length", "stop")
        else:
            with pytest.raises(QvlError) as info:
                client.generate(params)
            assert info.value.code == code, info.value.message
    still_good(hostile)


def test_metrics_bind_and_socket_mode_are_what_the_config_says(tmp_path: Path) -> None:
    import socket as s

    with s.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    daemon = Daemon(tmp_path, metrics_listen=f"127.0.0.1:{port}",
                    args=["--set", "server.socket_mode=0600"]).start()
    try:
        assert oct(os.stat(daemon.socket).st_mode & 0o777) == "0o600"
        listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
        mine = [f[1] for f in listening if f[3] == "0A" and int(f[1].split(":")[1], 16) == port]
        assert mine == [f"0100007F:{port:04X}"]  # 127.0.0.1 only
    finally:
        assert daemon.stop() == 0


def test_sigkill_and_restart_leave_no_stale_state(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).start()
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait(10)
    daemon._log.close()
    assert daemon.socket.exists()  # a dead daemon's socket file stays behind...
    again = Daemon(tmp_path).start()  # ...and the next one replaces it
    try:
        still_good(again)
        with again.client() as client:
            assert client.sessions() == []
    finally:
        assert again.stop() == 0


@pytest.mark.parametrize("fault", ["truncated", "missing"])
def test_broken_model_file_at_start_exits_78_naming_it(tmp_path: Path, fault: str) -> None:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("images", "reference*"))
    target = model / "openvino_vision_embeddings_merger_model.bin"
    if fault == "truncated":
        target.write_bytes(target.read_bytes()[:1000])
    else:
        target.with_suffix(".xml").unlink()
    daemon = Daemon(tmp_path, model=model).start(wait_ready=False)
    assert daemon.proc is not None and daemon.proc.wait(60) == 78
    errors = [line for line in daemon.log().splitlines() if line.split()[2:3] == ["ERROR"]]
    assert len(errors) == 1 and "openvino_vision_embeddings_merger_model" in errors[0], errors


def test_unusable_cache_dir_serves_without_it_and_warns_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    daemon = Daemon(tmp_path, args=["--set", f"model.cache_dir={blocker}/cache"]).start()
    try:
        still_good(daemon)
    finally:
        assert daemon.stop() == 0
    assert daemon.log().count("is not usable") == 1


def test_missing_socket_directory_is_created(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, socket_path=tmp_path / "deep" / "er" / "qvld.sock").start()
    try:
        still_good(daemon)
    finally:
        assert daemon.stop() == 0
