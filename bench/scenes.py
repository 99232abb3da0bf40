"""Photo-like test images for the benchmarks: smooth gradients and noise, one per seed."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def scene_image(size: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    img = np.stack([255 * x / size, 255 * y / size,
                    128 + 100 * np.sin((x + y + seed) / 23)], -1)
    img += rng.normal(0, 8, img.shape)
    return Image.fromarray(img.clip(0, 255).astype(np.uint8))


def scene(size: int, seed: int) -> bytes:
    """The scene as PNG bytes (what a client sends)."""
    buf = io.BytesIO()
    scene_image(size, seed).save(buf, "PNG")
    return buf.getvalue()
