"""Video through the engine on the committed tiny model: prompts and greedy ids equal
transformers' for the reference clips (H.264/MP4, VP9/WebM, H.265/MKV, with images and
several turns), budgets hold for long clips, and every kind of bad file is
``video_invalid`` with nothing else harmed."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

from qvld.engine import Engine, GenerateRequest
from qvld.engine.inputs.prompt_builder import PrepareStopped
from qvld.engine.inputs.video import prepare_video, sample_indices, timestamps, video_resize
from qvld.engine.model.model_dir import VideoSpec
from qvld.errors import VideoInvalid
from tests.conftest import TINY, load_reference, parity_config, with_image_bytes

VIDEO_CASES = load_reference(TINY)["video_cases"]
CLIP = (TINY / "images" / "clip.mp4").read_bytes()


def make_clip(seconds: float = 2.0, fps: int = 10, width: int = 96, height: int = 64,
              codec: str = "libx264", container: str = "mp4") -> bytes:
    """A moving gradient, encoded with PyAV (its wheels carry the encoders)."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        y, x = np.mgrid[0:height, 0:width]
        for i in range(int(seconds * fps)):
            rgb = np.stack([(x * 3 + i * 9) % 256, (y * 4 + i * 5) % 256,
                            (x + y + i * 7) % 256], -1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()


def ask(video: bytes, **kw: Any) -> GenerateRequest:
    return GenerateRequest(messages=[{"role": "user", "content": [
        {"type": "video", "video": video}, {"type": "text", "text": "What happens?"}]}],
        temperature=0.0, **kw)


@pytest.mark.parametrize("case", VIDEO_CASES, ids=[c["name"] for c in VIDEO_CASES])
def test_video_prompts_and_greedy_ids_equal_transformers(tiny_engine: Engine,
                                                         case: dict[str, Any]) -> None:
    request = GenerateRequest(messages=with_image_bytes(case["messages"], TINY),
                              max_tokens=case["max_new_tokens"], temperature=0.0,
                              template_kwargs=case.get("template_kwargs"))
    ids, *_ = tiny_engine.tokenize(request)
    assert ids == case["input_ids"]
    result = tiny_engine.generate(request)
    assert result.token_ids == case["token_ids"]
    assert result.usage.prompt_tokens == len(case["input_ids"])


def test_the_reference_covers_codecs_images_and_turns() -> None:
    files = {part["video"] for c in VIDEO_CASES for m in c["messages"]
             if isinstance(m["content"], list) for part in m["content"]
             if part["type"] == "video"}
    assert files == {"clip.mp4", "clip.webm", "clip.mkv"}
    assert any(m["role"] == "assistant" for c in VIDEO_CASES for m in c["messages"])
    assert all(c["min_margin"] > 1e-3 for c in VIDEO_CASES)


def test_a_clip_is_sampled_timed_and_placed_as_qwen_does(tiny_engine: Engine) -> None:
    ids, items, starts = tiny_engine.tokenize(ask(CLIP))
    text = tiny_engine.tokenizer.decode_special(ids)
    # 2 s at 10 fps -> 4 frames at 2 fps -> 2 groups of two frames, each with its time.
    assert text.count("<|vision_start|>") == 2 and "<0.3 seconds>" in text
    assert "<1.6 seconds>" in text
    assert len(items) == 2 and all(i.tokens == items[0].tokens for i in items)
    video_id = tiny_engine.spec.video_token_id
    assert all(ids[s] == video_id for s in starts)
    tiny_engine.generate(ask(CLIP, max_tokens=2))
    again = tiny_engine.generate(ask(CLIP, max_tokens=2))
    # Encoded before: nothing is encoded again (groups in the KV prefix cache are not
    # even looked up; the others come from the embedding cache).
    assert again.image_cache_misses == 0 and again.usage.cached_tokens > 0


def test_sampling_and_timestamps_follow_transformers() -> None:
    spec = VideoSpec()
    assert sample_indices(20, 10.0, spec, 768).tolist() == [0, 6, 13, 19]
    assert sample_indices(300, 30.0, spec, 768).tolist() == list(
        np.linspace(0, 299, 20).round().astype(int))
    assert len(sample_indices(300, 30.0, spec, 8)) == 8  # the token budget's cap
    assert timestamps([0, 6, 13], 10.0, 2) == [0.3, 1.3]  # the last frame repeated
    assert video_resize(4, 64, 96, 32, 2, 128 * 32 * 32, 768 * 32 * 32) == (160, 224)


@pytest.mark.parametrize(("codec", "container"), [("libx265", "matroska"),
                                                  ("libvpx-vp9", "webm"),
                                                  ("libsvtav1", "mp4")])
def test_other_codecs_decode(tiny_engine: Engine, codec: str, container: str) -> None:
    clip = make_clip(1.0, 8, 64, 64, codec, container)
    video = prepare_video(clip, tiny_engine.spec.vision, tiny_engine.spec.video, 2048,
                          10 ** 8, lambda: False, max_clip_pixels=10 ** 10)
    assert len(video.groups) == 2 and video.frames == 4


def test_a_long_clip_stays_within_the_video_budget() -> None:
    long = make_clip(60.0, 10, 160, 96)
    engine = Engine(parity_config(TINY))
    ids, items, _ = engine.tokenize(ask(long))
    video_tokens = sum(i.tokens for i in items)
    assert len(ids) < 4096 and video_tokens <= 2048
    assert len(items) >= 16  # a minute is not squeezed into a few frames
    tight = prepare_video(long, engine.spec.vision, engine.spec.video, 64, 10 ** 8,
                          lambda: False, max_clip_pixels=10 ** 10)
    assert tight.tokens <= 64 and len(tight.groups) >= 2


@pytest.mark.parametrize(("name", "data", "message"), [
    ("empty", b"", "empty"),
    ("garbage", b"\x00\x01not a video at all" * 100, "cannot be read"),
    ("truncated", CLIP[: len(CLIP) // 2], "cannot be read"),
])
def test_bad_files_are_video_invalid(tiny_engine: Engine, name: str, data: bytes,
                                     message: str) -> None:
    with pytest.raises(VideoInvalid, match=message):
        tiny_engine.tokenize(ask(data))
    assert tiny_engine.generate(ask(CLIP, max_tokens=2)).finish_reason == "length"


def test_frames_over_the_decode_limit_are_refused() -> None:
    engine = Engine(parity_config(TINY, max_decode_pixels=96 * 63))
    with pytest.raises(VideoInvalid, match=r"engine\.max_decode_pixels"):
        engine.tokenize(ask(CLIP))


def test_an_audio_only_file_has_no_video_stream(tiny_engine: Engine) -> None:
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="matroska") as muxer:
        stream = muxer.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16",
                                           layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    with pytest.raises(VideoInvalid, match="no video stream"):
        tiny_engine.tokenize(ask(out.getvalue()))


def test_decoding_stops_when_asked(tiny_engine: Engine) -> None:
    with pytest.raises(PrepareStopped):
        tiny_engine.tokenize(ask(CLIP), should_stop=lambda: True)


def test_a_video_given_as_frames(tiny_engine: Engine) -> None:
    import av

    with av.open(io.BytesIO(CLIP)) as container:
        pictures = []
        for frame in container.decode(video=0):
            out = io.BytesIO()
            frame.to_image().save(out, "PNG")
            pictures.append(out.getvalue())
    picked = [pictures[i] for i in (0, 6, 13, 19)]  # the frames the clip's sampling takes
    as_frames = GenerateRequest(messages=[{"role": "user", "content": [
        {"type": "video", "frames": picked}, {"type": "text", "text": "What happens?"}]}],
        temperature=0.0, max_tokens=4)
    ids, items, _ = tiny_engine.tokenize(as_frames)
    text = tiny_engine.tokenizer.decode_special(ids)
    assert len(items) == 2 and "<0.2 seconds>" in text and "<1.2 seconds>" in text
    # The same frames as the clip gives (lossless PNGs of its decoded frames): the same
    # patches, only the times differ (frames are taken as 0.5 s apart).
    _, clip_items, _ = tiny_engine.tokenize(ask(CLIP))
    assert [np.array_equal(a.patches, b.patches) for a, b in zip(items, clip_items,
                                                                 strict=True)] == [True, True]
    assert tiny_engine.generate(as_frames).usage.completion_tokens == 4
    with pytest.raises(VideoInvalid, match="same size"):
        tiny_engine.tokenize(GenerateRequest(messages=[{"role": "user", "content": [
            {"type": "video", "frames": [picked[0],
                                         (TINY / "images" / "photo.png").read_bytes()]}]}]))



def test_a_clip_that_would_cost_too_many_pixels_to_decode_is_refused_before_decoding(
        tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """#46: 225 KB of H.264 (one 7680x7680 picture, 2 999 skipped ones) was decoded frame
    by frame until the deadline: 300 s, +1 GB. What decoding a clip would produce (its
    frames up to the last sampled one, times their pixels) is checked from the header:
    here a budget below this clip's, and not one frame is decoded."""
    from qvld.engine.inputs import video

    clip = make_clip(seconds=10, fps=10, width=256, height=192)  # 100 frames
    decoded: list[int] = []
    resized = video._resized
    monkeypatch.setattr(video, "_resized", lambda rgb, size: decoded.append(1)
                        or resized(rgb, size))
    monkeypatch.setattr(tiny_engine.prompts, "max_clip_decode_pixels", 99 * 256 * 192)
    with pytest.raises(VideoInvalid, match=r"100 frames of 256x192 decoded \(4,915,200 "
                       r"pixels\); at most 4,866,048 .*engine.max_clip_decode_pixels.* "
                       "shorter or smaller"):
        tiny_engine.generate(ask(clip, max_tokens=2))
    assert decoded == []
    monkeypatch.setattr(tiny_engine.prompts, "max_clip_decode_pixels", 100 * 256 * 192)
    assert tiny_engine.generate(ask(clip, max_tokens=2)).usage.completion_tokens == 2
    assert decoded  # within the budget: decoded as ever


def half_static_clip(seconds: float = 3.0, fps: int = 10, width: int = 128,
                     height: int = 64) -> bytes:
    """The left half a still picture, the right half moving: what pruning drops first."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as muxer:
        stream = muxer.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "0"}  # lossless: the still half stays exactly still
        y, x = np.mgrid[0:height, 0:width]
        still = np.stack([(x * 5) % 256, (y * 7) % 256, (x * y) % 256], -1)
        for i in range(int(seconds * fps)):
            moving = np.stack([(x * 3 + i * 29) % 256, (y * 11 + i * 17) % 256,
                               (x + y + i * 41) % 256], -1)
            rgb = np.where(x[..., None] < width // 2, still, moving).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()


def test_pruning_drops_the_tokens_that_did_not_change_first() -> None:
    from qvld.engine.inputs.video import pruned_tokens

    rng = np.random.default_rng(0)
    first = rng.standard_normal((4 * 6, 12)).astype(np.float32)  # 6 merged tokens
    second = first.copy()
    second[4 * 3:] += rng.standard_normal((4 * 3, 12)).astype(np.float32)  # 3 changed
    third = second.copy()  # nothing changed
    kept = pruned_tokens([first, second, third], merge=2, rate=0.45)
    # 18 tokens, 10 kept: all of the first group, the three that changed, and the best
    # of the still third group (every group keeps one).
    assert kept[0].tolist() == list(range(6))
    assert kept[1].tolist() == [3, 4, 5]
    assert len(kept[2]) == 1
    assert [len(k) for k in pruned_tokens([first, second, third], 2, 0.0)] == [6, 6, 6]
    # However high the rate, the first group and one token of each other stay.
    assert [len(k) for k in pruned_tokens([first, second, third], 2, 0.95)] == [6, 1, 1]


def test_kept_tokens_keep_their_unpruned_positions_and_the_text_after_them_too() -> None:
    from qvld.engine.decoding.generation import mrope_positions

    whole, delta = mrope_positions(30, [(2, 3, 4), (16, 3, 4)])
    keep = np.array([0, 5, 6, 11])
    pruned, pruned_delta = mrope_positions(
        30 - 8, [(2, 3, 4, keep), (2 + len(keep) + 2, 3, 4)])
    assert np.array_equal(pruned[:, 2:6], whole[:, 2 + keep])
    assert np.array_equal(pruned[:, 6:], whole[:, 14:])  # the rest is moved, not changed
    assert pruned_delta == delta + 8  # the same last position, 8 rows fewer


def test_a_pruned_clip_has_fewer_rows_each_at_its_own_position_and_is_answered() -> None:
    clip = half_static_clip()
    full = Engine(parity_config(TINY, prefill_chunk=64))
    pruned = Engine(parity_config(TINY, prefill_chunk=64).model_copy(update={
        "model": parity_config(TINY).model.model_copy(update={"video_pruning": 0.4})}))
    ids, items, starts = full.tokenize(ask(clip))
    pruned_ids, pruned_items, pruned_starts = pruned.tokenize(ask(clip))
    per_group = items[0].tokens
    total = sum(i.tokens for i in items)
    kept = sum(i.tokens for i in pruned_items)
    assert len(items) == len(pruned_items) >= 3
    assert pruned_items[0].tokens == per_group  # the first pair whole
    assert kept == max(-(-total * 6 // 10), per_group + len(items) - 1)
    assert len(pruned_ids) == len(ids) - (total - kept)
    # The still left half goes first: every kept token of a later pair is on the right.
    grid_w = items[0].merged_grid[1]
    assert all((g.keep % grid_w >= grid_w // 2).all() for g in pruned_items[1:])
    # Each kept token's positions are its unpruned ones.
    full_prompt = full.prompts.assemble(full.pool.slots[0], ids, items, starts)
    pruned_prompt = pruned.prompts.assemble(pruned.pool.slots[0], pruned_ids, pruned_items,
                                            pruned_starts)
    assert full_prompt is not None and pruned_prompt is not None
    for group, pruned_group, start, pruned_start in zip(items, pruned_items, starts,
                                                        pruned_starts, strict=True):
        keep = pruned_group.keep
        rows = np.arange(group.tokens) if keep is None else keep
        assert np.array_equal(pruned_prompt.positions[:, pruned_start:pruned_start + len(rows)],
                              full_prompt.positions[:, start + rows])
    assert pruned_prompt.rope_delta - full_prompt.rope_delta == len(ids) - len(pruned_ids)
    assert pruned_prompt.visual_embeds.shape[0] == kept
    result = pruned.generate(ask(clip, max_tokens=4))
    assert result.usage.image_tokens == kept and len(result.token_ids) == 4
    # Pruning is part of the clip's identity in the caches: the unpruned engine's
    # embeddings are never taken for the pruned clip's (or the reverse).
    assert items[1].digest != pruned_items[1].digest
