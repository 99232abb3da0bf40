"""Reference cases and what transformers (fp32, greedy) generates for them.

The cases are plain data (``TEXT_CASES``, ``IMAGE_CASES``) so that the test suite can
read them back from ``reference.json`` without torch; the images are generated here
(deterministically) into ``OUT/images`` and referred to by file name.
``write_reference`` runs transformers on a saved Hugging Face model directory and
records, per case: the prompt ids, the generated ids (including the eos id when
generation ended on it, as ``generate`` returns them) and the smallest top-1/top-2 logit
margin seen, so a fragile (near-tie) case shows up at once; and the processor's
pixel_values and grid per image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LONG_TEXT = (
    "Systems that run on small CPU servers must answer fast, stay up and be observable. "
    "The daemon listens on a Unix socket, reads msgpack frames and streams tokens back. "
    "Red, green, blue, yellow, black and white are colours; circles, squares and lines. "
)

# Each case: name, messages (HF/OpenAI style), max_new_tokens.
TEXT_CASES: list[dict[str, Any]] = [
    {"name": "short", "messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 16},
    {
        "name": "question",
        "messages": [{"role": "user", "content": "What is in this picture? Describe the image."}],
        "max_new_tokens": 24,
    },
    {
        "name": "system",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "How many people are in the photo?"},
        ],
        "max_new_tokens": 24,
    },
    {
        "name": "multi_turn",
        "messages": [
            {"role": "user", "content": "What colours are there?"},
            {"role": "assistant", "content": "Red, green and blue."},
            {"role": "user", "content": "And the shapes?"},
        ],
        "max_new_tokens": 24,
    },
    {
        "name": "non_ascii",
        "messages": [{"role": "user", "content": "Grüße! 你好，世界 🌍 — ¿Qué tal? Добрый день."}],
        "max_new_tokens": 24,
    },
    {
        "name": "parts",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Describe "},
                                         {"type": "text", "text": "the receipt."}]}
        ],
        "max_new_tokens": 20,
    },
    {
        "name": "long",
        "messages": [{"role": "user", "content": LONG_TEXT * 2 + "Summarise."}],
        "max_new_tokens": 24,
    },
    {
        "name": "longer_than_chunk",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": LONG_TEXT * 6 + "What is the daemon for?"},
        ],
        "max_new_tokens": 32,
    },
]


IMAGE_PROMPT = "What is in this picture?"


def _image_case(name: str, image: str, question: str = IMAGE_PROMPT) -> dict[str, Any]:
    return {
        "name": f"image_{name}",
        "messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                  {"type": "text", "text": question}]}],
        "max_new_tokens": 16,
    }


# name -> (file name, what it exercises). Kept small so the fixture stays a few MB.
IMAGES: dict[str, str] = {
    "photo": "photo.png",          # RGB, shrunk under the pixel budget
    "large": "large.jpg",          # JPEG, much larger than the budget
    "small": "small.png",          # grown to the minimum pixels
    "tall": "tall.png",            # 1:13 aspect ratio
    "wide": "wide.webp",           # WebP, wide
    "gray": "gray.png",            # mode L
    "rgba": "rgba.png",            # alpha, composited on white
    "palette": "palette.png",      # mode P
    "jpeg": "photo.jpg",           # plain JPEG
    "cmyk": "cmyk.jpg",            # CMYK JPEG
    "exif": "exif.jpg",            # EXIF orientation 6 (rotated when displayed)
    "gif": "anim.gif",             # first frame of an animated GIF
    "bmp": "plain.bmp",            # BMP
}

IMAGE_CASES: list[dict[str, Any]] = [
    *(_image_case(name, file) for name, file in IMAGES.items()),
    {
        "name": "two_images_one_message",
        "messages": [{"role": "user", "content": [
            {"type": "image", "image": "photo.png"},
            {"type": "text", "text": "Compare this"},
            {"type": "image", "image": "gray.png"},
            {"type": "text", "text": "with that."}]}],
        "max_new_tokens": 16,
    },
    {
        "name": "images_in_two_turns",
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "small.png"},
                                         {"type": "text", "text": "What colours are there?"}]},
            {"role": "assistant", "content": "Red, green and blue."},
            {"role": "user", "content": [{"type": "image", "image": "tall.png"},
                                         {"type": "text", "text": "And here?"}]},
        ],
        "max_new_tokens": 16,
    },
    {
        "name": "image_with_system",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": [{"type": "image", "image": "photo.jpg"},
                                         {"type": "text", "text": "How many people?"}]},
        ],
        "max_new_tokens": 16,
    },
    _image_case("non_ascii_question", "palette.png", "Что на картинке? 图片里有什么？"),
    {
        "name": "text_after_image_first",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image", "image": "wide.webp"}]}],
        "max_new_tokens": 16,
    },
]


# Tool calling through Qwen3-VL's own template (``tools=``, assistant tool_calls, tool
# results) and its variables (``add_vision_id``); the engine takes the same tools.
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}
TOOL_CASES: list[dict[str, Any]] = [
    {
        "name": "tools_question",
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "max_new_tokens": 16,
    },
    {
        "name": "tools_with_system_and_image",
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "image", "image": "photo.png"},
                                         {"type": "text", "text": "Where is this? "
                                          "What is the weather there?"}]}],
        "max_new_tokens": 16,
    },
    {
        "name": "tools_call_and_results",
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "messages": [
            {"role": "user", "content": "Weather and time in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call_2", "type": "function", "function": {
                    "name": "get_time", "arguments": '{"zone": "Europe/Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
        ],
        "max_new_tokens": 16,
    },
    {
        "name": "vision_ids",
        "template_kwargs": {"add_vision_id": True},
        "messages": [{"role": "user", "content": [
            {"type": "image", "image": "small.png"}, {"type": "image", "image": "gray.png"},
            {"type": "text", "text": "Which picture is brighter?"}]}],
        "max_new_tokens": 12,
    },
]


# Videos: sampled, timed and placed as Qwen3VLProcessor does; mixed with images, text
# and several turns.
VIDEO_CASES: list[dict[str, Any]] = [
    {
        "name": "video_question",
        "messages": [{"role": "user", "content": [
            {"type": "video", "video": "clip.mp4"},
            {"type": "text", "text": "What happens in this clip?"}]}],
        "max_new_tokens": 16,
    },
    {
        "name": "video_after_an_image_turn",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": [{"type": "image", "image": "small.png"},
                                         {"type": "text", "text": "What colours are there?"}]},
            {"role": "assistant", "content": "Red, green and blue."},
            {"role": "user", "content": [{"type": "text", "text": "And in this video?"},
                                         {"type": "video", "video": "clip.webm"}]},
        ],
        "max_new_tokens": 16,
    },
    {
        "name": "two_videos_numbered",
        "template_kwargs": {"add_vision_id": True},
        "messages": [{"role": "user", "content": [
            {"type": "video", "video": "clip.mkv"}, {"type": "image", "image": "gray.png"},
            {"type": "video", "video": "clip.mp4"},
            {"type": "text", "text": "Which one moves fastest? Answer briefly."}]}],
        "max_new_tokens": 12,
    },
]


# Multi-turn sessions: each turn's messages are only the new ones; the daemon appends
# them to the exact token history (prompt + generated ids) of the turns before.
SESSION_CASES: list[dict[str, Any]] = [
    {
        "name": "session_text",
        "turns": [
            {"messages": [{"role": "user", "content": "What colours are there?"}],
             "max_new_tokens": 12},
            {"messages": [{"role": "user", "content": "And the shapes?"}],
             "max_new_tokens": 12},
            {"messages": [{"role": "user", "content": "Thanks. Grüße!"}],
             "max_new_tokens": 8},
        ],
    },
    {
        "name": "session_image_follow_up",
        "turns": [
            {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                          {"role": "user", "content": [
                              {"type": "image", "image": "photo.png"},
                              {"type": "text", "text": "What is in this picture?"}]}],
             "max_new_tokens": 12},
            {"messages": [{"role": "user", "content": "Describe it in more detail."}],
             "max_new_tokens": 12},
        ],
    },
    {
        "name": "session_new_image",
        "turns": [
            {"messages": [{"role": "user", "content": [
                {"type": "image", "image": "small.png"},
                {"type": "text", "text": "What is this?"}]}], "max_new_tokens": 10},
            {"messages": [{"role": "user", "content": [
                {"type": "image", "image": "gray.png"},
                {"type": "text", "text": "And this one?"}]}], "max_new_tokens": 10},
        ],
    },
]

HISTORY_MARKER = "\x00qvld-history\x00"


def _scene(height: int, width: int, seed: int) -> Any:
    """A smooth RGB scene (gradients, discs, a little noise): compresses well, not flat."""
    import numpy as np

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([
        255 * x / max(width - 1, 1),
        255 * y / max(height - 1, 1),
        128 + 100 * np.sin((x + y) / 23.0),
    ], axis=-1)
    for _ in range(4):
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        r = rng.uniform(0.1, 0.4) * min(height, width)
        disc = (y - cy) ** 2 + (x - cx) ** 2 < r * r
        img[disc] = rng.uniform(0, 255, size=3)
    img += rng.normal(0, 6, size=img.shape)
    return img.clip(0, 255).astype(np.uint8)


def write_images(folder: Path) -> None:
    """Write the reference images (deterministic bytes for a given Pillow version)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_scene(200, 300, 1)).save(folder / "photo.png")
    Image.fromarray(_scene(900, 1200, 2)).save(folder / "large.jpg", quality=70)
    Image.fromarray(_scene(30, 40, 3)).save(folder / "small.png")
    Image.fromarray(_scene(780, 60, 4)).save(folder / "tall.png")
    Image.fromarray(_scene(100, 700, 5)).save(folder / "wide.webp", quality=80)
    Image.fromarray(_scene(256, 256, 6)).convert("L").save(folder / "gray.png")
    rgba = Image.fromarray(_scene(160, 200, 7)).convert("RGBA")
    alpha = Image.linear_gradient("L").resize(rgba.size)
    rgba.putalpha(alpha)
    rgba.save(folder / "rgba.png")
    Image.fromarray(_scene(240, 180, 8)).quantize(colors=32).save(folder / "palette.png")
    Image.fromarray(_scene(384, 512, 9)).save(folder / "photo.jpg", quality=90)
    Image.fromarray(_scene(240, 320, 10)).convert("CMYK").save(folder / "cmyk.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° clockwise when displayed
    Image.fromarray(_scene(200, 320, 11)).save(folder / "exif.jpg", exif=exif)
    frames = [Image.fromarray(_scene(96, 128, s)).quantize(colors=64) for s in (12, 13)]
    frames[0].save(folder / "anim.gif", save_all=True, append_images=frames[1:], duration=100)
    Image.fromarray(_scene(100, 100, 14)).save(folder / "plain.bmp")


# name -> file: short clips of moving scenes, one codec and container each.
VIDEOS: dict[str, str] = {
    "h264": "clip.mp4",     # H.264 in MP4, 2 s at 10 fps
    "vp9": "clip.webm",     # VP9 in WebM, 3 s at 8 fps
    "hevc": "clip.mkv",     # H.265 in Matroska, 1.5 s at 12 fps
}


def write_video(path: Path, seconds: float, fps: int, width: int, height: int, codec: str,
                seed: int) -> None:
    """A moving scene encoded on one thread (deterministic bytes for a given PyAV)."""
    import av
    import numpy as np

    base = _scene(height * 2, width * 2, seed)
    # bitexact: no random segment ids or dates in the container
    with av.open(str(path), "w", options={"fflags": "+bitexact"}) as out:
        options = {"libx264": {"threads": "1"},
                   "libx265": {"x265-params": "pools=1:frame-threads=1:log-level=error"}}
        stream = out.add_stream(codec, rate=fps, options=options.get(codec, {}))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.thread_count = 1
        for i in range(int(seconds * fps)):
            dy, dx = (3 * i) % height, (5 * i) % width  # the scene pans
            frame = np.ascontiguousarray(base[dy:dy + height, dx:dx + width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def write_videos(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_video(folder / "clip.mp4", 2.0, 10, 96, 64, "libx264", 21)
    write_video(folder / "clip.webm", 3.0, 8, 80, 64, "libvpx-vp9", 22)
    write_video(folder / "clip.mkv", 1.5, 12, 64, 96, "libx265", 23)


def load_reference_video(path: Path, video_processor: Any) -> tuple[Any, Any]:
    """The frames transformers' video processor is given, and their metadata: decoded
    with PyAV, sampled by the processor's own ``sample_frames``, sized by its own
    ``smart_resize``, resized with Pillow's bicubic filter (qvld's; transformers' fast
    processor would use torchvision's, not installable here beside a CPU torch), so that
    its own resize is the identity."""
    import av
    import numpy as np
    from PIL import Image
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
    from transformers.video_utils import VideoMetadata

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        fps = float(stream.average_rate)
    meta = VideoMetadata(total_num_frames=len(frames), fps=fps, width=frames[0].shape[1],
                         height=frames[0].shape[0])
    indices = video_processor.sample_frames(meta)
    size = video_processor.size
    height, width = smart_resize(len(indices), frames[0].shape[0], frames[0].shape[1],
                                 temporal_factor=video_processor.temporal_patch_size,
                                 factor=video_processor.patch_size * video_processor.merge_size,
                                 min_pixels=size["shortest_edge"],
                                 max_pixels=size["longest_edge"])
    picked = [np.asarray(Image.fromarray(frames[i]).resize((width, height),
                                                           Image.Resampling.BICUBIC))
              for i in indices]
    meta.frames_indices = [int(i) for i in indices]
    return np.stack(picked), meta


def video_case_inputs(processor: Any, case: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A case with videos (and images): the template's text, then the processor with the
    frames (its own timestamps, placeholders, patches) and the images."""
    import torch
    import transformers.image_processing_utils_fast as fast
    from transformers.image_utils import PILImageResampling

    # Without torchvision: the fast processor's two torchvision calls on this path (the
    # resize mode lookup; normalize, here (x - mean) / std as torchvision computes it).
    class _Normalize:
        @staticmethod
        def normalize(x: Any, mean: Any, std: Any) -> Any:
            mean_t = torch.as_tensor(mean, dtype=x.dtype).view(-1, 1, 1)
            std_t = torch.as_tensor(std, dtype=x.dtype).view(-1, 1, 1)
            return x.sub(mean_t).div(std_t)

    fast.pil_torch_interpolation_mapping = {m: m.name.lower() for m in PILImageResampling}
    fast.tvF = _Normalize  # type: ignore[attr-defined]
    images, videos, metas = [], [], []
    for message in case["messages"]:
        if isinstance(message["content"], str):
            continue
        for part in message["content"]:
            if part["type"] == "image":
                images.append(load_reference_image(folder / part["image"]))
            elif part["type"] == "video":
                frames, meta = load_reference_video(folder / part["video"],
                                                    processor.video_processor)
                videos.append(frames)
                metas.append(meta)
    text = processor.apply_chat_template(
        _with_images(case["messages"], folder, load=False), add_generation_prompt=True,
        tokenize=False, **case.get("template_kwargs", {}))
    return dict(processor(text=[text], images=images or None, videos=videos,
                          videos_kwargs={"video_metadata": metas, "do_resize": False,
                                         "do_sample_frames": False},
                          return_tensors="pt"))


def load_reference_image(path: Path) -> Any:
    """The image transformers is given: EXIF-rotated, RGB, transparency on white.

    transformers' processor itself drops alpha (``convert("RGB")``); Qwen's own pipeline
    (qwen-vl-utils) composites it on white first, and so does qvld.
    """
    from PIL import Image
    from transformers.image_utils import load_image

    with Image.open(path) as raw:
        has_alpha = raw.mode in ("RGBA", "LA", "PA") or "transparency" in raw.info
        if has_alpha:
            rgba = raw.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
    return load_image(str(path))


def build_processor(hf_dir: Path) -> Any:
    """Qwen3VLProcessor without torchvision: its video processor base is patched in."""
    import transformers
    import transformers.processing_utils as processing_utils
    from transformers import AutoTokenizer, Qwen2VLImageProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    transformers.BaseVideoProcessor = BaseVideoProcessor
    processing_utils.transformers_module.BaseVideoProcessor = BaseVideoProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # The checkpoint's own video settings where it has them, else the video processor's
    # defaults with the model's own patch sizes (as the image processor's config has them).
    if (hf_dir / "video_preprocessor_config.json").is_file():
        video = Qwen3VLVideoProcessor.from_pretrained(hf_dir)
    else:
        vision = json.loads((hf_dir / "config.json").read_text())["vision_config"]
        video = Qwen3VLVideoProcessor(
            patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
            merge_size=vision["spatial_merge_size"])
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor.from_pretrained(hf_dir),
        tokenizer=AutoTokenizer.from_pretrained(hf_dir),
        video_processor=video,
        chat_template=(hf_dir / "chat_template.jinja").read_text(),
    )


def generate_reference(model: Any, inputs: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    import torch

    with torch.no_grad():
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
        )
    prompt_len = inputs["input_ids"].shape[1]
    generated = out.sequences[0, prompt_len:].tolist()
    margins = []
    for scores in out.scores:
        top = torch.topk(scores[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return {
        "input_ids": inputs["input_ids"][0].tolist(),
        "token_ids": generated,
        "min_margin": min(margins),
    }


def _with_images(messages: list[dict[str, Any]], folder: Path,
                 load: bool = True) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):  # the processor wants parts; the template renders both
            # (an empty text, e.g. beside tool calls, as no parts: the template tests it)
            content = [{"type": "text", "text": content}] if content else []
        else:
            content = [
                {"type": "image", "image": load_reference_image(folder / part["image"])}
                if part["type"] == "image" and load else
                {"type": part["type"]} if part["type"] in ("image", "video") else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


def session_reference(processor: Any, model: Any, case: dict[str, Any],
                      images: Path) -> dict[str, Any]:
    """Greedy ids per turn, transformers on the exact sequence: history (prompt and
    generated ids) + the template's continuation for the new messages."""
    import torch

    tokenizer = processor.tokenizer
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    history: list[int] = []
    pixel_values: list[Any] = []
    grids: list[Any] = []
    turns = []
    for turn in case["turns"]:
        messages = _with_images(turn["messages"], images)
        if history:
            marker = {"role": "assistant", "content": [{"type": "text", "text": HISTORY_MARKER}]}
            text = processor.apply_chat_template([marker, *messages], tokenize=False,
                                                 add_generation_prompt=True)
            text = text.split(HISTORY_MARKER, 1)[1]
            closing = tokenizer.decode(history[-1:])
            if history[-1] in eos_ids and text.startswith(closing):
                text = text[len(closing):]
        else:
            text = processor.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        pictures = [p["image"] for m in messages if isinstance(m["content"], list)
                    for p in m["content"] if p["type"] == "image"]
        encoded = processor(text=[text], images=pictures or None, return_tensors="pt")
        if pictures:
            pixel_values.append(encoded["pixel_values"])
            grids.append(encoded["image_grid_thw"])
        input_ids = history + encoded["input_ids"][0].tolist()
        inputs: dict[str, Any] = {"input_ids": torch.tensor([input_ids]),
                                  "attention_mask": torch.ones(1, len(input_ids), dtype=torch.long)}
        if pixel_values:
            inputs["pixel_values"] = torch.cat(pixel_values)
            inputs["image_grid_thw"] = torch.cat(grids)
        ref = generate_reference(model, inputs, turn["max_new_tokens"])
        turns.append({**turn, **ref})
        history = input_ids + ref["token_ids"]
    return {"name": case["name"], "turns": turns}


def write_reference(hf_dir: Path, out_dir: Path, preset: str) -> Path:
    import numpy as np
    import torch
    from transformers import Qwen3VLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    processor = build_processor(hf_dir)
    model = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    images = out_dir / "images"
    write_images(images)
    cases = []
    for case in TEXT_CASES + IMAGE_CASES:
        inputs = processor.apply_chat_template(
            _with_images(case["messages"], images),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        ref = generate_reference(model, dict(inputs), case["max_new_tokens"])
        cases.append({**case, **ref})
    tool_cases = []
    for case in TOOL_CASES:
        inputs = processor.apply_chat_template(
            _with_images(case["messages"], images), tools=case.get("tools"),
            add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt", **case.get("template_kwargs", {}))
        tool_cases.append({**case, **generate_reference(model, dict(inputs),
                                                        case["max_new_tokens"])})
    write_videos(images)
    video_cases = []
    for case in VIDEO_CASES:
        inputs = video_case_inputs(processor, case, images)
        video_cases.append({**case, **generate_reference(model, inputs,
                                                         case["max_new_tokens"])})
    sessions = [session_reference(processor, model, case, images) for case in SESSION_CASES]
    # The processor's pixel_values and grid per image, each processed on its own.
    pixels: dict[str, Any] = {}
    for name, file in IMAGES.items():
        out = processor.image_processor(images=[load_reference_image(images / file)],
                                        return_tensors="np")
        pixels[f"{name}/pixel_values"] = out["pixel_values"].astype(np.float32)
        pixels[f"{name}/grid_thw"] = out["image_grid_thw"][0]
    np.savez_compressed(out_dir / "reference_pixels.npz", **pixels)
    path = out_dir / "reference.json"
    document = {"preset": preset, "images": IMAGES, "cases": cases, "sessions": sessions,
                "tool_cases": tool_cases, "videos": VIDEOS, "video_cases": video_cases}
    path.write_text(json.dumps(document, ensure_ascii=False, indent=1))
    return path
