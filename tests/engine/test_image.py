"""Image decoding, validation and patches; parity with transformers' processor."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from qvld.engine import Engine, GenerateRequest
from qvld.engine.inputs.image import PixelBudget, decode, prepare, smart_resize
from qvld.engine.model.model_dir import load_model_spec
from qvld.errors import BadRequest, ImageInvalid, ImageTooLarge
from tests.conftest import TINY, load_reference

REFERENCE = load_reference(TINY)
PIXELS = np.load(TINY / "reference_pixels.npz")
SPEC = load_model_spec(TINY, "openvino")
BUDGET = PixelBudget.for_request(SPEC.vision, 256)
LIMIT = 64_000_000


def encode(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def scene(height: int = 64, width: int = 96) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.mark.parametrize("name", sorted(REFERENCE["images"]))
def test_patches_equal_the_transformers_processor(name: str) -> None:
    data = (TINY / "images" / REFERENCE["images"][name]).read_bytes()
    image = prepare(data, SPEC.vision, BUDGET, LIMIT)
    expected = PIXELS[f"{name}/pixel_values"]
    assert [1, image.grid_h, image.grid_w] == PIXELS[f"{name}/grid_thw"].tolist()
    assert image.patches.shape == expected.shape
    assert np.abs(image.patches - expected).max() <= 1e-5


def test_reference_covers_the_image_kinds() -> None:
    kinds = set(REFERENCE["images"])
    assert len(kinds) >= 10
    assert {"large", "small", "tall", "gray", "rgba", "palette", "jpeg", "cmyk",
            "exif"} <= kinds


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (200, 300, (192, 288)),  # rounded to multiples of 32
        (30, 40, (64, 96)),  # grown to min_pixels (ceil)
        (900, 1200, (416, 576)),  # shrunk under max_pixels (floor)
    ],
)
def test_smart_resize(height: int, width: int, expected: tuple[int, int]) -> None:
    assert smart_resize(height, width, 32, 4096, 262144) == expected


def test_budget_is_the_smallest_of_request_engine_and_model() -> None:
    assert PixelBudget.for_request(SPEC.vision, 64).max_pixels == 64 * 32 * 32
    assert PixelBudget.for_request(SPEC.vision, 10_000).max_pixels == SPEC.vision.max_pixels
    assert PixelBudget.for_request(SPEC.vision, 1).max_pixels == SPEC.vision.min_pixels


def test_exif_orientation_is_applied() -> None:
    data = (TINY / "images" / "exif.jpg").read_bytes()
    with Image.open(io.BytesIO(data)) as raw:
        assert raw.size == (320, 200)
    assert decode(data, LIMIT).size == (200, 320)


def test_gif_takes_the_first_frame() -> None:
    frames = [Image.new("RGB", (40, 30), c) for c in ((250, 0, 0), (0, 0, 250))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    pixel = decode(data, LIMIT).getpixel((5, 5))
    assert isinstance(pixel, tuple) and pixel[0] > 200 and pixel[2] < 50


def test_transparency_is_composited_on_white() -> None:
    clear = Image.new("RGBA", (40, 40), (0, 0, 0, 0))
    assert decode(encode(clear, "PNG"), LIMIT).getpixel((3, 3)) == (255, 255, 255)
    la = Image.new("LA", (40, 40), (0, 0))
    assert decode(encode(la, "PNG"), LIMIT).getpixel((3, 3)) == (255, 255, 255)
    palette = Image.new("P", (40, 40), 0)
    palette.putpalette([0, 0, 0] * 256)
    assert decode(encode(palette, "PNG", transparency=0), LIMIT).getpixel((3, 3)) == (
        255, 255, 255)


def test_sixteen_bit_grayscale_is_scaled_not_clipped() -> None:
    ramp = (np.arange(64 * 64, dtype=np.uint32).reshape(64, 64) * 16).astype(np.uint16)
    image = decode(encode(Image.fromarray(ramp), "PNG"), LIMIT)
    out = np.asarray(image)[:, :, 0]
    np.testing.assert_array_equal(out, (ramp >> 8).astype(np.uint8))


def test_cmyk_and_grayscale_become_rgb() -> None:
    for mode in ("CMYK", "L"):
        image = decode(encode(scene().convert(mode), "JPEG"), LIMIT)
        assert image.mode == "RGB" and image.size == (96, 64)


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(
            ">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_decompression_bomb_is_refused_before_decoding() -> None:
    bomb = _png_header_only(100_000, 100_000)
    with pytest.raises(ImageTooLarge):
        decode(bomb, LIMIT)
    with pytest.raises(ImageTooLarge):
        decode(encode(scene(100, 100), "PNG"), max_decode_pixels=5_000)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not an image at all",
        encode(scene(), "PNG")[:200],  # truncated PNG
        encode(scene(), "JPEG")[:300],  # truncated JPEG
        encode(scene(), "TIFF"),  # a real image, but not a format we take
        _png_header_only(0, 10),
        encode(Image.new("RGB", (1, 300)), "PNG"),  # aspect ratio 300:1
    ],
    ids=["empty", "garbage", "truncated_png", "truncated_jpeg", "tiff", "no_pixels",
         "aspect_ratio"],
)
def test_bad_images_are_image_invalid(data: bytes) -> None:
    with pytest.raises(ImageInvalid) as refused:
        prepare(data, SPEC.vision, BUDGET, LIMIT)
    # Words for the client, never a Python repr of Pillow's in-memory file.
    assert " object at 0x" not in str(refused.value) and "<" not in str(refused.value)


def test_data_that_is_no_image_says_which_formats_are_taken() -> None:
    with pytest.raises(ImageInvalid, match="not a PNG, JPEG, WEBP, GIF or BMP image"):
        decode(b"not an image at all", LIMIT)


def test_bad_image_in_a_request_leaves_the_engine_serving(tiny_engine: Engine) -> None:
    good = (TINY / "images" / "small.png").read_bytes()

    def ask(data: bytes) -> GenerateRequest:
        return GenerateRequest(messages=[{"role": "user", "content": [
            {"type": "image", "image": data}, {"type": "text", "text": "What?"}]}],
            max_tokens=3, temperature=0.0)

    before = tiny_engine.generate(ask(good)).token_ids
    for bad, error in ((b"junk", ImageInvalid), (_png_header_only(90_000, 90_000),
                                                 ImageTooLarge)):
        with pytest.raises(error):
            tiny_engine.generate(ask(bad))
    assert tiny_engine.generate(ask(good)).token_ids == before


def test_image_tokens_follow_the_request_budget(tiny_engine: Engine) -> None:
    data = (TINY / "images" / "large.jpg").read_bytes()
    messages = [{"role": "user", "content": [{"type": "image", "image": data},
                                             {"type": "text", "text": "What?"}]}]
    default = tiny_engine.generate(GenerateRequest(messages=messages, max_tokens=1))
    small = tiny_engine.generate(GenerateRequest(messages=messages, max_tokens=1,
                                                 max_image_tokens=16))
    assert default.usage.image_tokens == 26 * 36 // 4
    assert 4 <= small.usage.image_tokens <= 16
    assert small.usage.prompt_tokens < default.usage.prompt_tokens
    with pytest.raises(BadRequest):
        tiny_engine.generate(GenerateRequest(messages=messages, max_image_tokens=0))


def test_too_many_images_is_bad_request(tiny_engine: Engine) -> None:
    data = (TINY / "images" / "small.png").read_bytes()
    parts = [{"type": "image", "image": data}] * (tiny_engine.config.engine.max_images + 1)
    with pytest.raises(BadRequest):
        tiny_engine.generate(GenerateRequest(messages=[{"role": "user", "content": parts}]))


def test_image_results_report_image_time(tiny_engine: Engine, tiny_dir: Path) -> None:
    data = (tiny_dir / "images" / "photo.png").read_bytes()
    result = tiny_engine.generate(GenerateRequest(messages=[{"role": "user", "content": [
        {"type": "image", "image": data}]}], max_tokens=2))
    assert result.timings.image_s > 0
    assert result.timings.ttft_s >= result.timings.image_s
    assert result.usage.image_tokens == 12 * 18 // 4


def test_cancellation_acts_between_images(tiny_dir: Path) -> None:
    from tests.conftest import parity_config

    engine = Engine(parity_config(tiny_dir, infer_requests=1))
    data = [(tiny_dir / "images" / name).read_bytes() for name in ("photo.png", "gray.png")]

    def stop_after_first_image() -> bool:
        return engine.images.stats()["entries"] >= 1

    result = engine.generate(GenerateRequest(messages=[{"role": "user", "content": [
        {"type": "image", "image": data[0]}, {"type": "image", "image": data[1]}]}]),
        should_stop=stop_after_first_image)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert engine.images.stats()["entries"] == 1  # the second image was never encoded


def test_prepare_stops_between_images_when_told(tiny_dir: Path) -> None:
    """The prepare stage's own stop (a deadline or a client gone while large images are
    decoded): the images after it are never decoded."""
    from qvld.engine.inputs.prompt_builder import PrepareStopped
    from tests.conftest import parity_config

    engine = Engine(parity_config(tiny_dir, infer_requests=1))
    data = [(tiny_dir / "images" / name).read_bytes() for name in ("photo.png", "gray.png",
                                                                    "tall.png")]
    polls = {"n": 0}

    def stop_after_first_image() -> bool:
        polls["n"] += 1
        return polls["n"] > 1

    request = GenerateRequest(messages=[{"role": "user", "content": [
        {"type": "image", "image": image} for image in data]}])
    with pytest.raises(PrepareStopped, match="after 1 of 3 images"):
        engine.prepare(request, should_stop=stop_after_first_image)
    assert polls["n"] == 2
    assert len(engine.prepare(request).images) == 3  # without a stop: all of them
