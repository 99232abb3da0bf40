"""Video bytes -> sampled frames -> vision patches, as Qwen3-VL's video processor does it.

Decoding is PyAV's (FFmpeg's decoders: H.264, H.265, VP9, AV1 in MP4, WebM, MKV, ...;
the wheels carry them, no system FFmpeg needed). The steps follow transformers'
``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor``:

- frames sampled at ``fps`` (``VideoSpec``; 2 by default): ``int(total / video_fps *
  fps)`` frames, within [min_frames, max_frames] and the clip's own count, at
  ``linspace(0, total - 1, n).round()``;
- one size for every frame (``smart_resize`` over all sampled frames together: the
  pixel budget is the clip's, not a frame's), Pillow's bicubic filter (transformers'
  fast processor resizes with torchvision's antialiased bicubic, which can differ from
  Pillow's by one level in some pixels; the reference tests feed it frames resized so);
- ``(x - 255·mean) / (255·std)`` in float32 (its fused rescale and normalize), the last
  frame repeated to an even count, frames paired along time (temporal patch 2) and
  patchified in the 2x2 merge-block order;
- each pair of frames is one group of ``h·w/4`` tokens, placed in the prompt as
  ``<T seconds><|vision_start|><|video_pad|>…<|vision_end|>`` (T: the mean time of its
  two frames, one decimal) and encoded by the vision tower on its own (its attention
  is within the pair), so a group is an image to the rest of the engine.

Bounds: the clip's tokens (``model.video_max_tokens``: fewer frames, then smaller ones),
the frames decoded (``MAX_DECODED_FRAMES``), each frame's pixels
(``engine.max_decode_pixels``), all the pixels decoding it takes
(``engine.max_clip_decode_pixels``, from the header, before decoding), the decoder's threads
(``DECODER_THREADS``), and time (``should_stop``: the client left or the deadline
passed). Anything that is not a usable clip is ``video_invalid``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from qvld.engine.inputs.image import MAX_ASPECT_RATIO, PixelBudget, PreparedImage
from qvld.engine.model.model_dir import VideoSpec, VisionSpec
from qvld.errors import VideoInvalid

# Frames a clip may have (decoded up to its last sampled frame): 2 hours at 60 fps.
MAX_DECODED_FRAMES = 432_000
# Pixels a clip may make the decoder produce (``engine.max_clip_decode_pixels``) are
# every frame up to its last sampled one, whatever the bytes sent: a 225 KB clip of one
# 7680x7680 picture and 2 999 skipped ones would be 177e9 (300 s of decoding, +1 GB).
# Decoder threads per clip: each frame thread holds a whole frame of its own.
DECODER_THREADS = 2
# Each group of two frames keeps at least this many tokens (128x128 pixels): a longer
# clip is sampled at fewer frames rather than shrunk to nothing.
MIN_GROUP_TOKENS = 16


class VideoStopped(Exception):
    """``should_stop`` fired while the clip was decoded."""


@dataclass(frozen=True)
class PreparedVideo:
    groups: list[PreparedImage]  # one per two frames, in time order
    timestamps: list[float]  # seconds, one per group
    digest: bytes
    frames: int  # sampled (before the pairing's padding)

    @property
    def tokens(self) -> int:
        return sum(g.tokens for g in self.groups)

    def placeholder(self, start: str, pad: str, end: str) -> str:
        """What replaces the template's one ``start pad end`` for this clip (one pad per
        group: the pads are expanded to each group's tokens after tokenising)."""
        return "".join(f"<{t:.1f} seconds>{start}{pad}{end}" for t in self.timestamps)


def sample_indices(total: int, video_fps: float, spec: VideoSpec, most: int) -> np.ndarray:
    """transformers' ``sample_frames``, with at most ``most`` frames."""
    count = int(total / video_fps * spec.fps)
    count = min(max(count, spec.min_frames), spec.max_frames, total, most)
    return np.linspace(0, total - 1, count).round().astype(int)  # type: ignore[no-any-return]


def timestamps(indices: list[int], video_fps: float, pair: int) -> list[float]:
    """Each group's time: the mean of its first and last frame's (``_calculate_timestamps``)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % pair)
    times = [i / video_fps for i in padded]
    return [(times[i] + times[i + pair - 1]) / 2 for i in range(0, len(times), pair)]


def video_resize(frames: int, height: int, width: int, factor: int, temporal: int,
                 min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The frame size for ``frames`` frames (transformers' video ``smart_resize``)."""
    if height < factor or width < factor:
        raise VideoInvalid(f"the video is {width}x{height}; frames must be at least "
                           f"{factor}x{factor} pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoInvalid(f"aspect ratio {max(height, width) / min(height, width):.0f}:1 "
                           f"exceeds {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = math.ceil(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _open(data: bytes) -> tuple[Any, Any]:
    """The container and its first video stream (PyAV's objects)."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError, UnicodeDecodeError) as exc:
        raise VideoInvalid(f"the video cannot be read: {_problem(exc)}") from None
    streams = container.streams.video
    if not streams:
        container.close()
        raise VideoInvalid("the file has no video stream")
    stream = streams[0]
    stream.thread_type = "AUTO"
    stream.thread_count = DECODER_THREADS
    return container, stream


def _problem(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return str(text).split(": '<", 1)[0].strip() or type(exc).__name__


def _frame_count(data: bytes, stream: Any) -> int:
    """The stream's frames: its header's count, else its packets counted (no decoding)."""
    frames = int(getattr(stream, "frames", 0) or 0)
    if frames > 0:
        return frames
    import av

    container, stream = _open(data)
    try:
        count = 0
        for packet in container.demux(stream):
            if packet.size:
                count += 1
                if count > MAX_DECODED_FRAMES:
                    break
        return count
    except av.FFmpegError as exc:
        raise VideoInvalid(f"the video cannot be read: {_problem(exc)}") from None
    finally:
        container.close()


SizeFor = Callable[[int, int, int], tuple[int, int]]  # (frames, height, width) -> (h, w)


def decode_frames(data: bytes, spec: VideoSpec, most: int, max_decode_pixels: int,
                  should_stop: Callable[[], bool], size_for: SizeFor,
                  max_clip_pixels: int) -> tuple[list[np.ndarray], list[int], float]:
    """The sampled frames (RGB uint8 HWC, resized as each is decoded to ``size_for``:
    only the clip's budget of pixels is ever held), their indices, and the frame rate."""
    import av

    if not data:
        raise VideoInvalid("the video is empty")
    container, stream = _open(data)
    try:
        width, height = int(stream.width or 0), int(stream.height or 0)
        if width * height > max_decode_pixels:
            raise VideoInvalid(f"the video's frames are {width}x{height} pixels; at most "
                               f"{max_decode_pixels} are decoded (engine.max_decode_pixels)")
        rate = stream.average_rate or stream.guessed_rate
        video_fps = float(rate) if rate else 0.0
        if not video_fps > 0:
            raise VideoInvalid("the video has no frame rate")
        total = _frame_count(data, stream)
        if total < 1:
            raise VideoInvalid("the video has no frames")
        if total > MAX_DECODED_FRAMES:
            raise VideoInvalid(f"the video has over {MAX_DECODED_FRAMES} frames; "
                               "send a shorter clip")
        indices = sample_indices(total, video_fps, spec, most)
        decoded = (int(indices[-1]) + 1) * width * height
        if decoded > max_clip_pixels:
            # The web page words its own check the same (web/clip.js): keep them equal.
            raise VideoInvalid(f"the video would have {int(indices[-1]) + 1} frames of "
                               f"{width}x{height} decoded ({decoded:,} pixels); at most "
                               f"{max_clip_pixels:,} are decoded for one clip "
                               "(engine.max_clip_decode_pixels): send a shorter or "
                               "smaller one")
        wanted: dict[int, list[int]] = {}  # frame -> where it goes (short clips repeat one)
        for n, i in enumerate(indices):
            wanted.setdefault(int(i), []).append(n)
        size = size_for(len(indices), height, width) if width and height else None
        frames: list[np.ndarray | None] = [None] * len(indices)
        last = int(indices[-1])
        position = -1
        try:
            for frame in container.decode(stream):
                position += 1
                if should_stop():
                    raise VideoStopped(f"stopped after {position} of {total} frames")
                if frame.width * frame.height > max_decode_pixels:
                    raise VideoInvalid(f"a frame is {frame.width}x{frame.height} pixels; at "
                                       f"most {max_decode_pixels} are decoded "
                                       "(engine.max_decode_pixels)")
                if position in wanted:
                    rgb = _resized(frame.to_ndarray(format="rgb24"), size)
                    for n in wanted[position]:
                        frames[n] = rgb
                if position >= last:
                    break
        except av.FFmpegError as exc:
            raise VideoInvalid(f"the video cannot be decoded: {_problem(exc)}") from None
        missing = sum(1 for f in frames if f is None)
        if missing:  # the stream ended before the frames its header or packets promised
            raise VideoInvalid(f"the video is cut short: {missing} of its {len(frames)} "
                               f"sampled frames (up to frame {last}) could not be decoded")
        return [f for f in frames if f is not None], [int(i) for i in indices], video_fps
    finally:
        container.close()


def _resized(rgb: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
    if size is None or rgb.shape[:2] == size:
        return rgb
    return np.asarray(Image.fromarray(rgb).resize((size[1], size[0]),
                                                  Image.Resampling.BICUBIC))


def normalize_frames(frames: np.ndarray, spec: VideoSpec) -> np.ndarray:
    """uint8 [T,H,W,C] -> float32 [T,C,H,W]: the fused ``(x - mean/r) / (std/r)``."""
    scale = np.float32(1.0 / spec.rescale_factor)
    mean = (np.asarray(spec.image_mean, dtype=np.float32) * scale).astype(np.float32)
    std = (np.asarray(spec.image_std, dtype=np.float32) * scale).astype(np.float32)
    x = frames.astype(np.float32).transpose(0, 3, 1, 2)
    return np.ascontiguousarray((x - mean[:, None, None]) / std[:, None, None])


def patchify_pair(pair: np.ndarray, vision: VisionSpec) -> np.ndarray:
    """[T,C,H,W] (T = temporal patch) -> [gh*gw, C*T*P*P] in merge-block order."""
    p, m = vision.patch_size, vision.merge_size
    t, c, h, w = pair.shape
    gh, gw = h // p, w // p
    x = pair.reshape(t, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p))


def video_digest(data: bytes, max_tokens: int, pruning: float = 0.0) -> bytes:
    pruned = f":pruned {pruning:g}" if pruning else ""
    return hashlib.sha256(hashlib.sha256(data).digest() + f"video:{max_tokens}{pruned}".encode()
                          ).digest()


def prepare_video(data: bytes, vision: VisionSpec, spec: VideoSpec, max_tokens: int,
                  max_decode_pixels: int, should_stop: Callable[[], bool],
                  pruning: float = 0.0, *, max_clip_pixels: int) -> PreparedVideo:
    """Decode, sample, resize and patchify a clip within ``max_tokens`` tokens (less the
    share ``pruning`` drops: ``pruned_tokens``)."""
    def size_for(count: int, height: int, width: int) -> tuple[int, int]:
        return frame_size(count, height, width, vision, spec, max_tokens)

    frames, indices, video_fps = decode_frames(
        data, spec, _most_frames(vision, max_tokens), max_decode_pixels, should_stop,
        size_for, max_clip_pixels)
    return _groups(frames, indices, video_fps, video_digest(data, max_tokens, pruning), vision,
                   spec, max_tokens, pruning)


def prepare_frames(pictures: list[bytes], vision: VisionSpec, spec: VideoSpec,
                   max_tokens: int, max_decode_pixels: int,
                   should_stop: Callable[[], bool], pruning: float = 0.0) -> PreparedVideo:
    """A clip given as its frames (pictures, already sampled: taken as ``spec.fps``
    apart); more than the budget allows are thinned evenly."""
    from qvld.engine.inputs.image import decode

    if not pictures:
        raise VideoInvalid("a video's frames list is empty")
    keep = np.linspace(0, len(pictures) - 1, min(len(pictures), _most_frames(
        vision, max_tokens))).round().astype(int)
    frames: list[np.ndarray] = []
    for n in keep:
        if should_stop():
            raise VideoStopped(f"stopped after {len(frames)} of {len(keep)} frames")
        frames.append(np.asarray(decode(pictures[int(n)], max_decode_pixels), dtype=np.uint8))
    if any(f.shape != frames[0].shape for f in frames):
        raise VideoInvalid("a video's frames must all have the same size")
    content = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pictures)).digest()
    pruned = f":pruned {pruning:g}" if pruning else ""
    digest = hashlib.sha256(content + f"frames:{max_tokens}{pruned}".encode()).digest()
    return _groups(frames, [int(n) for n in keep], spec.fps, digest, vision, spec, max_tokens,
                   pruning)


def _most_frames(vision: VisionSpec, max_tokens: int) -> int:
    """No more frames than leave each pair MIN_GROUP_TOKENS of ``max_tokens``."""
    pair = vision.temporal_patch_size
    return max(pair, max_tokens // MIN_GROUP_TOKENS * pair)


def frame_size(count: int, height: int, width: int, vision: VisionSpec, spec: VideoSpec,
               max_tokens: int) -> tuple[int, int]:
    """Every frame's size for ``count`` frames of height x width: the model's video
    ``smart_resize``, its pixels over all frames within ``max_tokens`` too."""
    factor = vision.patch_size * vision.merge_size
    pair = vision.temporal_patch_size
    # Tokens = groups x (h·w / factor²): the pixels of all frames within the budget.
    max_pixels = min(spec.max_pixels, max_tokens * pair * factor * factor)
    h_bar, w_bar = video_resize(count, height, width, factor, pair,
                                min(spec.min_pixels, max_pixels), max_pixels)
    if math.ceil(count / pair) * pair * h_bar * w_bar > max_pixels:
        # Grown to the model's minimum past the token budget: the budget wins.
        h_bar, w_bar = video_resize(count, height, width, factor, pair, 0, max_pixels)
    return h_bar, w_bar


def _groups(frames: list[np.ndarray], indices: list[int], video_fps: float, digest: bytes,
            vision: VisionSpec, spec: VideoSpec, max_tokens: int,
            pruning: float = 0.0) -> PreparedVideo:
    """Sampled frames -> resized, normalised, paired and patchified groups."""
    pair = vision.temporal_patch_size
    if any(f.shape != frames[0].shape for f in frames):
        raise VideoInvalid("the video's frames change size")
    height, width = int(frames[0].shape[0]), int(frames[0].shape[1])
    h_bar, w_bar = frame_size(len(frames), height, width, vision, spec, max_tokens)
    frames = [_resized(f, (h_bar, w_bar)) for f in frames]
    stacked = np.stack(frames)
    if pad := -len(frames) % pair:
        stacked = np.concatenate([stacked, np.repeat(stacked[-1:], pad, axis=0)])
    chw = normalize_frames(stacked, spec)
    budget = PixelBudget(h_bar * w_bar, h_bar * w_bar)
    groups = [PreparedImage(
        patches=patchify_pair(chw[g:g + pair], vision),
        grid_h=h_bar // vision.patch_size, grid_w=w_bar // vision.patch_size,
        merge_size=vision.merge_size,
        digest=hashlib.sha256(digest + g.to_bytes(4, "big")).digest(),
        data=b"", budget=budget) for g in range(0, len(chw), pair)]
    if pruning and len(groups) > 1:
        kept = pruned_tokens([g.patches for g in groups if g.patches is not None],
                             vision.merge_size, pruning)
        groups = [dataclasses.replace(g, keep=k) for g, k in zip(groups, kept, strict=True)]
    return PreparedVideo(groups, timestamps(indices, video_fps, pair), digest, len(frames))


def pruned_tokens(groups: list[np.ndarray], merge: int, rate: float) -> list[np.ndarray]:
    """The merged tokens of each frame group to keep when ``rate`` of a clip's tokens
    are dropped, in the spirit of Efficient Video Sampling (EVS): every token of the
    first group is kept; each later token is scored by how much its pixels changed
    since the same place in the group before (1 - cosine of the normalised pixel
    vectors: a static patch scores 0), and the highest-scoring ones fill the rest of
    the budget. Every group keeps at least one token. ``groups``: each group's patches
    in merge-block order (``patchify_pair``), all of one grid. Returns, per group, the
    kept token indices (row-major over its merged grid), ascending."""
    per = merge * merge
    vectors = [g.reshape(len(g) // per, -1).astype(np.float64) for g in groups]
    unit = [v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-6) for v in vectors]
    scores = [np.full(len(unit[0]), np.inf)]
    scores += [1.0 - np.sum(now * before, axis=1) for before, now in itertools.pairwise(unit)]
    flat = np.concatenate(scores)
    chosen = np.zeros(len(flat), bool)
    at = 0
    for group in scores:  # the first group whole, and the best of each later one
        chosen[at + (np.arange(len(group)) if np.isinf(group).all() else int(np.argmax(group)))] \
            = True
        at += len(group)
    rest = math.ceil(len(flat) * (1.0 - rate)) - int(chosen.sum())
    if rest > 0:
        order = np.argsort(-np.where(chosen, -np.inf, flat), kind="stable")
        chosen[order[:rest]] = True
    kept, at = [], 0
    for group in scores:
        kept.append(np.flatnonzero(chosen[at:at + len(group)]))
        at += len(group)
    return kept
