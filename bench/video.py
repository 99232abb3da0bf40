"""A question about a video clip: qvld's engine against OpenVINO GenAI's VLMPipeline
(``videos=``) on the same IR, interleaved round by round in one process.

    python bench/video.py MODEL_DIR [--rounds 3] [--tokens 32] [--seconds 10]
                          [--size 1280x720] [--pruning RATE] [--json FILE]

Each round makes a new clip (H.264 MP4, a panning scene, 30 fps) so that no cache
helps either system, then asks both about it. qvld takes the clip's bytes and does
everything itself (decode, 2 fps sampling, resize within model.video_max_tokens,
vision, prefill); GenAI takes frames, so the same frames qvld samples are decoded for
it (that decode is timed and shown apart: a GenAI user has to do it). First token from
the call, then ms per token over ``--tokens`` tokens (eos ignored).

``--pruning RATE`` adds a third system, qvld with ``model.video_pruning: RATE`` (a second
engine in the same process), interleaved with the other two; each row says how many
video tokens it used.

The model directory needs video_preprocessor_config.json for the model's own video
budget; Qwen3-VL-2B-Instruct's values are written there when it is missing (the
random-weight bench export has none).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.systems import ensure_tokenizer_ir, token_stamps  # noqa: E402

QUESTION = "What happens in this video? Describe it."
# Qwen3-VL-2B-Instruct's video_preprocessor_config.json (its size and sampling keys).
QWEN3_VL_VIDEO = {"size": {"longest_edge": 25165824, "shortest_edge": 4096},
                  "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                  "fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True}


def make_clip(seconds: float, width: int, height: int, seed: int, fps: int = 30) -> bytes:
    import av

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height * 2, 0:width * 2].astype(np.float32)
    scene = np.stack([255 * x / (2 * width), 255 * y / (2 * height),
                      128 + 100 * np.sin((x + y) / 37.0)], -1)
    for _ in range(12):
        cy, cx, r = rng.uniform(0, 2 * height), rng.uniform(0, 2 * width), rng.uniform(20, 200)
        scene[(y - cy) ** 2 + (x - cx) ** 2 < r * r] = rng.uniform(0, 255, 3)
    scene = scene.clip(0, 255).astype(np.uint8)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as muxer:
        stream = muxer.add_stream("libx264", rate=fps, options={"preset": "veryfast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        frames = int(seconds * fps)
        for i in range(frames):
            dy, dx = int(height * i / frames), int(width * i / frames)  # a pan
            frame = np.ascontiguousarray(scene[dy:dy + height, dx:dx + width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()


def sampled_frames(clip: bytes, spec: Any) -> np.ndarray:
    """The frames qvld samples from ``clip``, at the clip's own size, for GenAI."""
    import av

    from qvld.engine.inputs.video import sample_indices

    with av.open(io.BytesIO(clip)) as container:
        stream = container.streams.video[0]
        total, fps = stream.frames, float(stream.average_rate)
        wanted = set(sample_indices(total, fps, spec, 10 ** 6).tolist())
        frames = [f.to_ndarray(format="rgb24") for i, f in
                  enumerate(container.decode(stream)) if i in wanted]
    return np.stack(frames)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--pruning", type=float, default=0.0,
                        help="also run qvld with model.video_pruning at this rate")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))

    import openvino as ov
    import openvino_genai as genai

    from qvld.config import Config, EngineConfig, ModelConfig
    from qvld.engine import Engine, GenerateRequest

    video_config = args.model / "video_preprocessor_config.json"
    if not video_config.exists():
        video_config.write_text(json.dumps(QWEN3_VL_VIDEO, indent=2))
    ensure_tokenizer_ir(args.model)
    engine = Engine(Config(model=ModelConfig(path=args.model), engine=EngineConfig()))
    engine.warmup()
    pruned = None
    if args.pruning:
        pruned = Engine(Config(model=ModelConfig(path=args.model, video_pruning=args.pruning),
                               engine=EngineConfig()))
        pruned.warmup()
    pipe = genai.VLMPipeline(str(args.model), "CPU")

    def prepare_s(clip: bytes) -> float:
        """What decoding, sampling, resizing and patchifying the clip takes alone."""
        from qvld.engine.inputs.video import prepare_video

        t0 = time.perf_counter()
        prepare_video(clip, engine.spec.vision, engine.spec.video,
                      engine.config.model.video_max_tokens,
                      engine.config.engine.max_decode_pixels, lambda: False,
                      max_clip_pixels=engine.config.engine.max_clip_decode_pixels)
        return time.perf_counter() - t0

    def ask_qvld(clip: bytes, engine: Engine = engine) -> dict[str, Any]:
        decode_s = prepare_s(clip)
        result = engine.generate(GenerateRequest(
            messages=[{"role": "user", "content": [{"type": "video", "video": clip},
                                                   {"type": "text", "text": QUESTION}]}],
            max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
        n = result.usage.completion_tokens
        return {"ttft_s": result.timings.ttft_s, "ms_per_token":
                1e3 * result.timings.decode_s / max(n - 1, 1),
                "prompt_tokens": result.usage.prompt_tokens,
                "video_tokens": result.usage.image_tokens,
                # Where the first token's time goes: the clip's decode and resize (timed
                # apart, beforehand), the vision encoder (the rest of image_s), prefill.
                "decode_resize_s": decode_s,
                "vision_s": result.timings.image_s - decode_s,
                "prefill_s": result.timings.prefill_s}

    def ask_genai(clip: bytes) -> dict[str, Any]:
        t0 = time.perf_counter()
        frames = sampled_frames(clip, engine.spec.video)
        decode_s = time.perf_counter() - t0
        config = genai.GenerationConfig()
        config.max_new_tokens = args.tokens
        config.ignore_eos = True
        stamps: list[float] = []
        t0 = time.perf_counter()
        result = pipe.generate(QUESTION, images=[], videos=[ov.Tensor(frames)],
                               generation_config=config, streamer=token_stamps(stamps))
        metrics = result.perf_metrics
        return {"ttft_s": stamps[0] - t0, "ms_per_token": metrics.get_tpot().mean,
                "prompt_tokens": int(metrics.get_num_input_tokens()),
                "frame_decode_s": decode_s, "frames": len(frames)}

    warm = make_clip(2.0, width, height, 999)
    ask_qvld(warm)
    ask_genai(warm)
    systems: list[tuple[str, Any]] = [("qvld", ask_qvld), ("genai", ask_genai)]
    if pruned is not None:
        ask_qvld(warm, pruned)
        systems.insert(1, (f"qvld-pruned-{args.pruning:g}",
                           lambda clip: ask_qvld(clip, pruned)))
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in systems}
    for r in range(args.rounds):
        clip = make_clip(args.seconds, width, height, r)
        for name, ask in systems if r % 2 == 0 else systems[::-1]:
            rows[name].append(ask(clip))
            print(name, r, json.dumps(rows[name][-1]), flush=True)

    def med(name: str, key: str) -> float:
        return float(statistics.median(row[key] for row in rows[name]))

    print(f"\n{args.seconds:g} s {width}x{height} clip, {args.tokens} tokens, "
          f"{args.rounds} interleaved rounds (medians)")
    print(f"{'system':18} {'first token s':>14} {'ms/token':>9} {'prompt tokens':>14} "
          f"{'video tokens':>13}")
    for name in rows:
        video = f"{med(name, 'video_tokens'):13.0f}" if name != "genai" else f"{'-':>13}"
        print(f"{name:18} {med(name, 'ttft_s'):14.2f} {med(name, 'ms_per_token'):9.1f} "
              f"{med(name, 'prompt_tokens'):14.0f} {video}")
    print(f"qvld on {engine.models.runtime}: decode + resize "
          f"{med('qvld', 'decode_resize_s'):.2f} s, vision {med('qvld', 'vision_s'):.2f} s, "
          f"prefill {med('qvld', 'prefill_s'):.2f} s; video tokens "
          f"{med('qvld', 'video_tokens'):.0f}")
    print(f"GenAI's frames decoded beforehand (not in its first token): "
          f"{med('genai', 'frame_decode_s'):.2f} s")
    for name in rows:
        if name != "genai":
            print(f"first token {name} / GenAI: "
                  f"{med(name, 'ttft_s') / med('genai', 'ttft_s'):.2f}; decode: "
                  f"{med(name, 'ms_per_token') / med('genai', 'ms_per_token'):.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
