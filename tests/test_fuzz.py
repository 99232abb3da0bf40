"""Fuzzing the frame decoder, request validation and the image decoder: only typed
errors, never a crash or a hang. The long runs are in the slow tier.

Every input is counted when it starts and when it ends in a value or a typed error;
test_report_fuzz_counts, last in the module, checks that each fuzz test ran before it
(in the same process: xdist's --dist loadfile keeps a module together), tried as many
inputs as it is set to, and that every one of them ended well."""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qvld import protocol
from qvld.engine.inputs.image import PixelBudget, prepare
from qvld.engine.inputs.request import parse_generate
from qvld.engine.model.model_dir import load_model_spec
from qvld.errors import BadRequest, FrameTooLarge, ImageInvalid, ImageTooLarge, QvlError
from tests.conftest import TINY

SCALE = float(os.environ.get("QVLD_FUZZ_SCALE", "1"))  # <1 for a quick local run


# Inputs each fuzz test must try; inputs started, and ended in a value or a typed error.
EXPECTED: dict[str, int] = {"frame_buffer": 2_000, "image": 3_000}
STARTED: Counter[str] = Counter()
ENDED: Counter[str] = Counter()


def fuzz(name: str, examples: int) -> Any:
    EXPECTED[name] = max(1, int(examples * SCALE))
    return settings(max_examples=EXPECTED[name], deadline=None,
                    derandomize=True, suppress_health_check=list(HealthCheck))


@contextlib.contextmanager
def counted(name: str) -> Iterator[None]:
    """One input of fuzz test ``name``: an exception leaving the block is not counted
    as ended (the test fails on it anyway, and so does the report)."""
    STARTED[name] += 1
    yield
    ENDED[name] += 1

SPEC = load_model_spec(TINY, "openvino")
BUDGET = PixelBudget.for_request(SPEC.vision, 256)

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20)
keys = st.sampled_from(["id", "op", "params", "messages", "max_tokens", "temperature",
                        "top_p", "top_k", "stop", "session", "stream", "seed", "deadline_s",
                        "role", "content", "type", "text", "image", "x"])
request_like = st.dictionaries(keys, values, max_size=6)


pytestmark = pytest.mark.slow


@fuzz("unpack", 80_000)  # cheap: most of the 10^5 inputs go here
@given(st.binary(max_size=200))
def test_unpack_arbitrary_bytes(data: bytes) -> None:
    with counted("unpack"), contextlib.suppress(BadRequest):
        protocol.unpack(data)


@fuzz("parse_request", 10_000)
@given(st.one_of(values, request_like))
def test_parse_request_arbitrary_objects(message: Any) -> None:
    try:
        payload = msgpack.packb(message, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        assume(False)  # not representable on the wire: no client can send it
        return
    with counted("parse_request"), contextlib.suppress(BadRequest):
        decoded = protocol.unpack(payload)
        protocol.parse_request(decoded)


@fuzz("parse_generate", 10_000)
@given(request_like)
def test_parse_generate_arbitrary_params(params: dict[str, Any]) -> None:
    with counted("parse_generate"), contextlib.suppress(BadRequest):
        parse_generate(params)


@settings(max_examples=EXPECTED["frame_buffer"], deadline=None, derandomize=True)
@given(st.lists(st.binary(max_size=64), max_size=20))
def test_frame_buffer_with_arbitrary_chunks(chunks: list[bytes]) -> None:
    buffer = protocol.FrameBuffer(max_frame_bytes=4096)
    with counted("frame_buffer"), contextlib.suppress(FrameTooLarge):
        for chunk in chunks:
            for frame in buffer.feed(chunk):
                assert len(frame) <= 4096


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
    for i in range(EXPECTED["image"]):
        data = mutate(originals[i % len(originals)], rng)
        t0 = time.perf_counter()
        with counted("image"):
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
    print(f"image mutations: {EXPECTED['image']} tried, {outcomes}, "
          f"slowest {slowest * 1000:.0f} ms")


def test_report_fuzz_counts() -> None:
    """Last in the module: what its fuzz tests tried, checked (not just printed)."""
    if not STARTED:
        pytest.skip("none of this module's fuzz tests ran in this process: nothing to "
                    "report (run the whole module)")
    missing = sorted(set(EXPECTED) - set(STARTED))
    assert not missing, f"fuzz tests that did not run before the report: {missing}"
    crashed = {name: STARTED[name] - ENDED[name] for name in EXPECTED
               if STARTED[name] != ENDED[name]}
    assert not crashed, f"inputs that ended in an untyped exception: {crashed}"
    short = {name: f"{ENDED[name]} of {want}" for name, want in EXPECTED.items()
             if ENDED[name] < want}
    assert not short, f"fuzz tests that tried fewer inputs than set: {short}"
    total = sum(ENDED.values())
    print(f"fuzz inputs: {dict(ENDED)} ({total} in all), each ended in a value or a "
          "typed error")
