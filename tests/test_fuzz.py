"""Fuzzing the frame decoder, request validation and the image decoder: only typed
errors, never a crash or a hang. The long runs are in the slow tier."""

from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qvld import protocol
from qvld.engine.image import PixelBudget, prepare
from qvld.engine.model_dir import load_model_spec
from qvld.errors import BadRequest, FrameTooLarge, ImageInvalid, ImageTooLarge, QvlError
from qvld.handlers import parse_generate
from tests.conftest import TINY

SCALE = float(os.environ.get("QVLD_FUZZ_SCALE", "1"))  # <1 for a quick local run


def fuzz(examples: int) -> Any:
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None,
                    derandomize=True, suppress_health_check=list(HealthCheck))

SPEC = load_model_spec(TINY)
BUDGET = PixelBudget.for_request(SPEC.vision, 256)
COUNTS: dict[str, int] = {}

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20)
keys = st.sampled_from(["id", "op", "params", "messages", "max_tokens", "temperature",
                        "top_p", "top_k", "stop", "session", "stream", "seed", "deadline_s",
                        "role", "content", "type", "text", "image", "x"])
request_like = st.dictionaries(keys, values, max_size=6)


def count(name: str) -> None:
    COUNTS[name] = COUNTS.get(name, 0) + 1


pytestmark = pytest.mark.slow


@fuzz(80_000)  # cheap: most of the 10^5 inputs go here
@given(st.binary(max_size=200))
def test_unpack_arbitrary_bytes(data: bytes) -> None:
    count("unpack")
    with contextlib.suppress(BadRequest):
        protocol.unpack(data)


@fuzz(10_000)
@given(st.one_of(values, request_like))
def test_parse_request_arbitrary_objects(message: Any) -> None:
    try:
        payload = msgpack.packb(message, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        assume(False)  # not representable on the wire: no client can send it
        return
    count("parse_request")
    try:
        decoded = protocol.unpack(payload)
        protocol.parse_request(decoded)
    except BadRequest:
        pass


@fuzz(10_000)
@given(request_like)
def test_parse_generate_arbitrary_params(params: dict[str, Any]) -> None:
    count("parse_generate")
    with contextlib.suppress(BadRequest):
        parse_generate(params)


@settings(max_examples=2_000, deadline=None, derandomize=True)
@given(st.lists(st.binary(max_size=64), max_size=20))
def test_frame_buffer_with_arbitrary_chunks(chunks: list[bytes]) -> None:
    count("frame_buffer")
    buffer = protocol.FrameBuffer(max_frame_bytes=4096)
    try:
        for chunk in chunks:
            for frame in buffer.feed(chunk):
                assert len(frame) <= 4096
    except FrameTooLarge:
        pass


def mutate(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        pos = rng.randrange(len(buf)) if buf else 0
        if kind < 0.5 and buf:
            buf[pos] = rng.randrange(256)
        elif kind < 0.7:
            del buf[pos:pos + rng.randint(1, 64)]
        elif kind < 0.85:
            buf[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            buf = buf[:pos]
    return bytes(buf)


def test_image_decoder_on_mutated_real_images() -> None:
    rng = random.Random(1234)
    originals = [p.read_bytes() for p in sorted((TINY / "images").iterdir())]
    outcomes: dict[str, int] = {}
    slowest = 0.0
    for i in range(3_000):
        data = mutate(originals[i % len(originals)], rng)
        t0 = time.perf_counter()
        try:
            prepare(data, SPEC.vision, BUDGET, max_decode_pixels=16_000_000)
            outcome = "decoded"
        except (ImageInvalid, ImageTooLarge) as exc:
            outcome = exc.code
        except QvlError as exc:  # pragma: no cover - any other typed error is a finding
            pytest.fail(f"unexpected {exc.code} on mutation {i}")
        slowest = max(slowest, time.perf_counter() - t0)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert slowest < 5.0
    print(f"image mutations: 3000 tried, {outcomes}, slowest {slowest * 1000:.0f} ms")


def test_report_fuzz_counts() -> None:
    total = sum(COUNTS.values())
    print(f"fuzz inputs: {COUNTS} ({total} in all), crashes 0")
    assert total >= 100_000 * SCALE or not COUNTS  # the full run (not a -k selection)
