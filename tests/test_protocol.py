"""Frames and message shapes: unit tests, then the same bad input against the daemon."""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qvld import protocol
from qvld.errors import BadRequest, FrameTooLarge, QvlError
from tests.conftest import Daemon


def test_pack_and_frame_buffer_round_trip() -> None:
    messages = [{"id": 1, "op": "health"}, {"id": 2, "op": "generate",
                                            "params": {"messages": [], "x": b"\x00\xff"}}]
    stream = b"".join(protocol.pack(m) for m in messages)
    buffer = protocol.FrameBuffer()
    frames = []
    for i in range(0, len(stream), 3):  # byte dribbles
        frames += buffer.feed(stream[i:i + 3])
    assert [protocol.unpack(f) for f in frames] == messages
    assert buffer.pending == 0


def test_frame_too_large_is_detected_from_the_header() -> None:
    with pytest.raises(FrameTooLarge):
        protocol.FrameBuffer(max_frame_bytes=1024).feed(struct.pack(">I", 1025))


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (msgpack.packb({"id": 1})[:-1], "ends inside"),
        (msgpack.packb(1) + msgpack.packb(2), "more than one"),
        (b"\xa3\xff\xfe\xfd", "UTF-8"),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb({1: "int key"}), "not valid msgpack"),
    ],
)
def test_unpack_errors_are_bad_request(payload: bytes, fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        protocol.unpack(payload)


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ([1, 2], "must be a map"),
        ({"op": "health"}, "integer id"),
        ({"id": True, "op": "health"}, "integer id"),
        ({"id": 1}, "needs an op"),
        ({"id": 1, "op": "dance"}, "unknown op"),
        ({"id": 1, "op": "health", "params": [1]}, "params must be a map"),
        ({"id": 1, "op": "health", "extra": 1}, "unknown request fields"),
    ],
)
def test_parse_request_errors(message: Any, fragment: str) -> None:
    with pytest.raises(BadRequest, match=fragment):
        protocol.parse_request(message)


def test_params_may_be_omitted() -> None:
    assert protocol.parse_request({"id": 3, "op": "health"}).params == {}
    assert protocol.parse_request({"id": 3, "op": "health", "params": None}).params == {}


def test_errors_round_trip_the_wire() -> None:
    from qvld.errors import ERRORS_BY_CODE

    for code, cls in ERRORS_BY_CODE.items():
        again = QvlError.from_wire(cls("why").to_wire())
        assert type(again) is cls and again.code == code and again.message == "why"
    assert QvlError.from_wire({"code": "from-the-future"}).code == "internal"


# -- the same against the real daemon ----------------------------------------------


class Raw:
    """A bare socket speaking frames by hand."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_payload(self, payload: bytes) -> None:
        self.sock.sendall(struct.pack(">I", len(payload)) + payload)

    def reply(self) -> dict[str, Any]:
        header = self._exactly(4)
        return dict(protocol.unpack(self._exactly(struct.unpack(">I", header)[0])))

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def still_serving(daemon: Daemon) -> None:
    with daemon.client() as client:
        assert client.health()["ready"]


@pytest.mark.parametrize(
    ("payload", "rid", "code"),
    [
        (msgpack.packb([1, 2, 3]), None, "bad_request"),  # not a map
        (b"\xa3\xff\xfe\xfd", None, "bad_request"),  # invalid UTF-8
        (msgpack.packb({"id": 1})[:-1], None, "bad_request"),  # cut msgpack
        (msgpack.packb({"id": 5, "op": "dance"}), 5, "bad_request"),  # unknown op
        (msgpack.packb({"id": 6, "op": "generate", "params": {"max_tokens": "x",
                                                              "messages": []}}), 6,
         "bad_request"),  # wrong param type
        (msgpack.packb({"id": 7, "op": "generate", "params": {"max_tokns": 3}}), 7,
         "bad_request"),  # unknown param
        (msgpack.packb({"id": 8, "op": "hello", "params": {"v": 2}}), 8,
         "unsupported_version"),
        (msgpack.packb({"id": 9, "op": "cancel", "params": {}}), 9, "bad_request"),
    ],
)
def test_bad_frames_get_typed_errors(daemon: Daemon, payload: bytes, rid: int | None,
                                     code: str) -> None:
    raw = Raw(str(daemon.socket))
    raw.send_payload(payload)
    reply = raw.reply()
    assert reply["id"] == rid and reply["ok"] is False
    assert reply["error"]["code"] == code and reply["error"]["message"]
    # The connection stays usable after a readable-but-wrong frame.
    raw.send_payload(msgpack.packb({"id": 99, "op": "health"}))
    assert raw.reply()["result"]["ready"] is True
    raw.close()
    still_serving(daemon)


def test_missing_params_is_fine(daemon: Daemon) -> None:
    raw = Raw(str(daemon.socket))
    raw.send_payload(msgpack.packb({"id": 1, "op": "health"}))
    assert raw.reply() == {"id": 1, "ok": True, "result": {"state": "ready", "ready": True}}
    raw.close()


def test_oversized_length_prefix_closes_the_connection(daemon: Daemon) -> None:
    raw = Raw(str(daemon.socket))
    raw.send_bytes(struct.pack(">I", 2**31))
    reply = raw.reply()
    assert reply["id"] is None and reply["error"]["code"] == "frame_too_large"
    assert raw.closed_by_peer()
    raw.close()
    still_serving(daemon)


def test_truncated_frames_do_not_hurt(daemon: Daemon) -> None:
    for data in (b"\x00\x00", struct.pack(">I", 100) + b"x" * 10):
        raw = Raw(str(daemon.socket))
        raw.send_bytes(data)
        raw.close()
    still_serving(daemon)


def test_duplicate_id_in_flight_is_refused(daemon: Daemon) -> None:
    raw = Raw(str(daemon.socket))
    generate = {"id": 4, "op": "generate", "params": {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 300,
        "ignore_eos": True}}
    raw.send_payload(msgpack.packb(generate))
    raw.send_payload(msgpack.packb({"id": 4, "op": "health"}))
    first = raw.reply()
    assert first["id"] == 4 and first["ok"] is False
    assert "already in flight" in first["error"]["message"]
    final = raw.reply()
    assert final["id"] == 4 and final["ok"] is True
    raw.close()


# -- what a frame may decode to -----------------------------------------------------------

def _values(obj: Any) -> int:
    """How many msgpack values ``obj`` packs to (a map's keys count)."""
    if isinstance(obj, dict):
        return 1 + sum(_values(k) + _values(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return 1 + sum(_values(v) for v in obj)
    return 1


_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
            | st.floats(allow_nan=False)
            | st.text(max_size=40) | st.binary(max_size=300))
_trees = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=20)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=20),
                      max_leaves=200)


@pytest.mark.slow  # 400 trees of up to 200 leaves: about 20 s here
@settings(max_examples=400, deadline=None)
@given(_trees)
def test_shape_walk_counts_exactly_what_the_decoder_builds(obj: Any) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    assert protocol.check_shape(payload) == _values(obj)
    assert protocol.unpack(payload) == obj


@pytest.mark.parametrize(
    ("name", "payload", "fragment"),
    [
        ("a million empty maps", msgpack.packb([{}] * 1_000_000), "more than 65536 values"),
        ("nested arrays of arrays", msgpack.packb([[[]] * 1000] * 1000), "more than 65536"),
        ("a map announcing 2^31 entries", b"\xdf\x7f\xff\xff\xff", "more than 65536"),
        ("33 levels deep", b"\x91" * 33 + b"\xc0", "deeper than 32 levels"),
    ],
)
def test_frames_that_would_decode_to_too_much_are_refused_before_decoding(
        name: str, payload: bytes, fragment: str) -> None:
    import time

    t0 = time.perf_counter()
    with pytest.raises(BadRequest, match=fragment):
        protocol.unpack(payload, 32 << 20)
    # Refused from the headers alone: far less than decoding (which took seconds).
    assert time.perf_counter() - t0 < 0.5


def test_the_budget_is_the_limit_not_less() -> None:
    at_budget = msgpack.packb([0] * (protocol.MAX_OBJECTS - 1))
    assert protocol.check_shape(at_budget) == protocol.MAX_OBJECTS
    assert len(protocol.unpack(at_budget)) == protocol.MAX_OBJECTS - 1
    assert protocol.unpack(b"\x91" * 31 + b"\xc0") is not None  # 32 levels: fine


def test_large_binaries_and_strings_are_stepped_over() -> None:
    image = bytes(range(256)) * 40_000  # 10 MB
    request = {"id": 1, "op": "generate", "params": {"messages": [
        {"role": "user", "content": [{"type": "image", "image": image},
                                     {"type": "text", "text": "x" * 1_000_000}]}]}}
    payload = msgpack.packb(request, use_bin_type=True)
    assert protocol.check_shape(payload) == _values(request)
    assert protocol.unpack(payload, 32 << 20) == request
