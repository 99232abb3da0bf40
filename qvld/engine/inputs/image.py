"""Image bytes -> vision patches: decode, validate, resize and patchify (Pillow + numpy).

The steps follow transformers' ``Qwen2VLImageProcessor`` (smart_resize, PIL bicubic,
x/255 then (x-mean)/std, the 2x2 merge-block patch order), so that the patches equal its
``pixel_values``. Images are refused before decoding when their header declares more
pixels than ``max_decode_pixels`` (decompression bombs), and anything that is not a
readable PNG/JPEG/WebP/GIF/BMP is ``image_invalid``.
"""

from __future__ import annotations

import hashlib
import io
import math
import re
import warnings
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from qvld.engine.model.model_dir import VisionSpec
from qvld.errors import ImageInvalid, ImageTooLarge

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class PixelBudget:
    """Pixels an image may be resized into (both multiples of factor² = (patch·merge)²)."""

    min_pixels: int
    max_pixels: int

    @classmethod
    def for_request(cls, vision: VisionSpec, image_tokens: int) -> PixelBudget:
        """``image_tokens`` (already capped by the engine) within the model's own limits."""
        factor = vision.patch_size * vision.merge_size
        max_pixels = min(image_tokens * factor * factor, vision.max_pixels)
        return cls(min_pixels=vision.min_pixels, max_pixels=max(max_pixels, vision.min_pixels))


@dataclass(frozen=True)
class PreparedImage:
    # [grid_h*grid_w, 3*T*P*P] float32 in merge-block order; None when the embedding
    # cache already holds this image (decoding was skipped; ``data`` can redo it).
    patches: np.ndarray | None
    grid_h: int  # in patches
    grid_w: int
    merge_size: int
    digest: bytes  # content + pixel budget: the identity caches use
    data: bytes
    budget: PixelBudget
    # The merged tokens kept (row-major over the merged grid, ascending) when pruning
    # dropped the rest (a video's frame group: model.video_pruning); None: all of them.
    keep: np.ndarray | None = field(default=None, compare=False)

    @property
    def tokens(self) -> int:
        if self.keep is not None:
            return len(self.keep)
        return self.grid_h * self.grid_w // (self.merge_size * self.merge_size)

    @property
    def merged_grid(self) -> tuple[int, int]:
        return self.grid_h // self.merge_size, self.grid_w // self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Round to multiples of ``factor`` and scale into [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageInvalid(f"aspect ratio {max(height, width) / min(height, width):.0f}:1 "
                           f"exceeds {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as Qwen's own pipeline sees it: transparency composited on white."""
    if image.mode == "RGB":
        return image
    if _has_alpha(image):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # Pillow clips 16-bit values to 255 when converting; scale them down instead.
        wide = np.asarray(image, dtype=np.uint32)
        return Image.fromarray((wide >> 8).clip(0, 255).astype(np.uint8), "L").convert("RGB")
    return image.convert("RGB")


def decode(data: bytes, max_decode_pixels: int) -> Image.Image:
    """Open, check the declared size, then decode the first frame with EXIF orientation."""
    if not data:
        raise ImageInvalid("the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise ImageInvalid(f"unsupported image format {image.format}; "
                                   f"expected one of {', '.join(FORMATS)}")
            width, height = image.size
            if width < 1 or height < 1:
                raise ImageInvalid("the image has no pixels")
            if width * height > max_decode_pixels:
                raise ImageTooLarge(f"the image declares {width}x{height} pixels; at most "
                                    f"{max_decode_pixels} are decoded "
                                    "(engine.max_decode_pixels)")
            image.seek(0)
            image.load()
            return to_rgb(ImageOps.exif_transpose(image))
    except (ImageInvalid, ImageTooLarge):
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own guard fires in open(), before the size is ours to read: the same
        # answer as ours, naming the key that sets it, not Pillow's wording.
        raise ImageTooLarge(f"the image declares more than {max_decode_pixels} pixels; "
                            f"at most {max_decode_pixels} are decoded "
                            "(engine.max_decode_pixels)") from exc
    except (OSError, SyntaxError, ValueError, TypeError, EOFError, IndexError,
            MemoryError) as exc:
        raise ImageInvalid(f"the image cannot be decoded: {decode_problem(exc)}") from exc


# Pillow's messages may name its in-memory file: "<_io.BytesIO object at 0x7f...>".
_PYTHON_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>")


def decode_problem(exc: BaseException) -> str:
    """What went wrong, in words for the client (no Python reprs)."""
    if isinstance(exc, UnidentifiedImageError):
        return f"not a {', '.join(FORMATS[:-1])} or {FORMATS[-1]} image"
    text = _PYTHON_REPR.sub("the data", str(exc)).strip()
    return text or type(exc).__name__


def normalize(rgb: np.ndarray, vision: VisionSpec) -> np.ndarray:
    """uint8 HWC -> float32 CHW, (x/255 - mean) / std with transformers' dtypes."""
    scaled = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(vision.image_mean, dtype=np.float32)
    std = np.asarray(vision.image_std, dtype=np.float32)
    return np.ascontiguousarray(((scaled - mean) / std).transpose(2, 0, 1))


def patchify(chw: np.ndarray, vision: VisionSpec) -> np.ndarray:
    """CHW frame -> [gh*gw, C*T*P*P], the frame repeated T times, merge blocks together."""
    p, t, m = vision.patch_size, vision.temporal_patch_size, vision.merge_size
    c, h, w = chw.shape
    gh, gw = h // p, w // p
    frames = np.broadcast_to(chw, (t, c, h, w))
    x = frames.reshape(1, t, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p))


def image_digest(data: bytes, budget: PixelBudget) -> bytes:
    """Same bytes under the same budget give the same patches: one identity for both."""
    content = hashlib.sha256(data).digest()
    return hashlib.sha256(content + f"{budget.min_pixels}:{budget.max_pixels}".encode()).digest()


def prepare(data: bytes, vision: VisionSpec, budget: PixelBudget, max_decode_pixels: int,
            known_grid: tuple[int, int] | None = None) -> PreparedImage:
    """Decode and patchify; with ``known_grid`` (a cached image) skip the decoding."""
    digest = image_digest(data, budget)
    if known_grid is not None:
        return PreparedImage(None, known_grid[0], known_grid[1], vision.merge_size, digest,
                             data, budget)
    image = decode(data, max_decode_pixels)
    factor = vision.patch_size * vision.merge_size
    height, width = smart_resize(image.height, image.width, factor,
                                 budget.min_pixels, budget.max_pixels)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    chw = normalize(np.asarray(image, dtype=np.uint8), vision)
    return PreparedImage(
        patches=patchify(chw, vision),
        grid_h=height // vision.patch_size,
        grid_w=width // vision.patch_size,
        merge_size=vision.merge_size,
        digest=digest,
        data=data,
        budget=budget,
    )
