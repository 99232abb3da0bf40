"""Read an exported Qwen3-VL model directory: every dimension, id and limit comes from here."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qvld.errors import ModelInvalid

if TYPE_CHECKING:
    from qvld.config import ModelConfig

SUBMODELS = (
    "language_model",
    "text_embeddings_model",
    "vision_embeddings_model",
    "vision_embeddings_pos_model",
    "vision_embeddings_merger_model",
)
LANGUAGE_SUBMODELS = ("language_model", "text_embeddings_model")
VISION_SUBMODELS = tuple(s for s in SUBMODELS if s not in LANGUAGE_SUBMODELS)


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults from generation_config.json (transformers' fallbacks otherwise)."""

    eos_token_ids: tuple[int, ...]
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class VisionSpec:
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    hidden_size: int
    num_heads: int
    num_position_embeddings: int
    deepstack_layers: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class VideoSpec:
    """video_preprocessor_config.json, or transformers' Qwen3VLVideoProcessor defaults:
    frames sampled at ``fps`` (at least ``min_frames``, at most ``max_frames``), and the
    pixels of all sampled frames together within [min_pixels, max_pixels]."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255


VIDEO_CONFIG = "video_preprocessor_config.json"


def processor_settings(path: Path) -> list[tuple[str, Any, str]]:
    """What turns a model directory's pictures and clips into patches: (setting, value,
    where it came from), as ``load_model_spec`` reads them; for ``check-config`` and
    ``qvlctl model info``. A directory without a video processor config is served with
    transformers' Qwen3VLVideoProcessor defaults, and says so here."""
    spec_vision = _read_json(path / "config.json").get("vision_config", {})
    image = _read_json(path / "preprocessor_config.json")
    image_size = image.get("size") or {}
    rows: list[tuple[str, Any, str]] = [
        (f"vision.{key}", spec_vision.get(key), "config.json")
        for key in ("patch_size", "temporal_patch_size", "spatial_merge_size")]
    rows += [
        ("image.min_pixels", image_size.get("shortest_edge") or image.get("min_pixels"),
         "preprocessor_config.json"),
        ("image.max_pixels", image_size.get("longest_edge") or image.get("max_pixels"),
         "preprocessor_config.json"),
        ("image.mean", image.get("image_mean"), "preprocessor_config.json"),
        ("image.std", image.get("image_std"), "preprocessor_config.json")]
    video_file = path / VIDEO_CONFIG
    video = _read_json(video_file) if video_file.is_file() else {}
    video_size = video.get("size") or {}
    spec = load_video_spec(path)
    missing = (f"transformers' default (no {VIDEO_CONFIG})" if not video_file.is_file()
               else f"transformers' default (not in {VIDEO_CONFIG})")
    for key, found in (("fps", video.get("fps")), ("min_frames", video.get("min_frames")),
                       ("max_frames", video.get("max_frames")),
                       ("min_pixels", video_size.get("shortest_edge")),
                       ("max_pixels", video_size.get("longest_edge")),
                       ("image_mean", video.get("image_mean")),
                       ("image_std", video.get("image_std"))):
        value = getattr(spec, key)
        rows.append((f"video.{key}", list(value) if isinstance(value, tuple) else value,
                     VIDEO_CONFIG if found else missing))
    return rows


def load_video_spec(path: Path) -> VideoSpec:
    file = path / VIDEO_CONFIG
    if not file.is_file():
        return VideoSpec()
    pre = _read_json(file)
    size = pre.get("size") or {}
    default = VideoSpec()
    return VideoSpec(
        fps=float(pre.get("fps") or default.fps),
        min_frames=int(pre.get("min_frames") or default.min_frames),
        max_frames=int(pre.get("max_frames") or default.max_frames),
        min_pixels=int(size.get("shortest_edge") or default.min_pixels),
        max_pixels=int(size.get("longest_edge") or default.max_pixels),
        image_mean=_rgb(pre.get("image_mean") or default.image_mean),
        image_std=_rgb(pre.get("image_std") or default.image_std),
        rescale_factor=float(pre.get("rescale_factor") or default.rescale_factor))


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    name: str
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    vision: VisionSpec
    generation: GenerationDefaults
    chat_template: str
    special_tokens: dict[str, str]
    video_token_id: int = -1
    video: VideoSpec = VideoSpec()

    def ir(self, submodel: str) -> Path:
        return ir_path(self.path, submodel)

    def onnx(self, submodel: str) -> Path:
        return onnx_path(self.path, submodel)


def ir_path(path: Path, submodel: str) -> Path:
    return path / f"openvino_{submodel}.xml"


def onnx_path(path: Path, submodel: str) -> Path:
    return path / f"onnx_{submodel}.onnx"


def onnx_metadata(graph: Path, key: str) -> str | None:
    """A metadata entry ``qvlctl model export-onnx`` wrote into a graph (``qvld.weights``:
    "int8", "fp32"; ``qvld.kv_cache``), read from the file's bytes without onnx or
    onnxruntime; None when absent. The metadata follows the graph in the file: its tail
    is enough when the weights are inline."""
    size = graph.stat().st_size
    with graph.open("rb") as f:
        f.seek(max(0, size - (1 << 20)))
        tail = f.read()
    # A StringStringEntryProto: the key (field 1), then the value (field 2).
    entry = b"\x0a" + bytes([len(key)]) + key.encode() + b"\x12"
    at = tail.rfind(entry)
    if at < 0 or at + len(entry) >= len(tail):
        return None
    length = tail[at + len(entry)]  # a varint: these values are short
    value = tail[at + len(entry) + 1:at + len(entry) + 1 + length]
    return value.decode("utf-8", "replace") if length < 128 else None


def onnx_weights(graph: Path) -> str | None:
    """A graph's ``qvld.weights`` ("int8", "fp32"), or None."""
    return onnx_metadata(graph, "qvld.weights")


# How the language model's graph holds its KV cache (``qvld.kv_cache``): "in-place",
# GroupQueryAttention writing new rows into the buffer the past came in. Graphs exported
# before have no entry: each step concatenated the past with the new rows.
KV_IN_PLACE = "in-place"
# How an int8 graph quantises its activations (``qvld.int8_activations``): "per-row",
# each token its own scale (``modeltools/onnx_int8``). int8 graphs exported before have
# no entry: one scale for a whole step, so co-running sequences moved each other's logits.
INT8_PER_ROW = "per-row"


def onnx_outdated(path: Path) -> str | None:
    """Why the ONNX language model in directory ``path`` cannot run here, or None: one
    exported before its KV cache was written in place, or with int8 activations
    quantised per tensor (batched answers differ from answers alone)."""
    graph = onnx_path(path, "language_model")
    if not graph.is_file():
        return None
    if onnx_metadata(graph, "qvld.kv_cache") != KV_IN_PLACE:
        why = "its KV cache is copied every step"
    elif onnx_weights(graph) == "int8" and \
            onnx_metadata(graph, "qvld.int8_activations") != INT8_PER_ROW:
        why = ("its int8 activations share one scale across a batch, so who else is "
               "decoding moves an answer")
    else:
        return None
    how = (f"`qvlctl model export-onnx CHECKPOINT {path} --weights int8` replaces them"
           if ir_path(path, "language_model").is_file() else
           "`qvlctl model export-onnx CHECKPOINT NEW_DIR --weights int8` exports them again")
    return f"{graph.name} was exported by an older qvld ({why}): {how}"


# The graph files each backend reads, and the command that writes them.
GRAPHS = {
    "openvino": (ir_path, "qvlctl model convert"),
    "onnxruntime": (onnx_path, "qvlctl model export-onnx"),
}

# CPU flags with which OpenVINO's CPU plugin multiplies int8 weights by quantised
# activations (its dynamic quantisation). Without any of them it decompresses int8
# weights and multiplies in f32, where ONNX Runtime's u8 x s8 kernels (any AVX2 CPU)
# prefill in half the time and decode a batch of sequences for little more than one.
INT8_DOT_PRODUCTS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags, from ``cpuinfo`` (/proc/cpuinfo's text; read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            cpuinfo = ""
    match = re.search(r"^flags\s*:\s*(.*)$", cpuinfo, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def resolve_backend(model: ModelConfig) -> tuple[str, str]:
    """``choose_backend`` for ``model`` on this machine's CPU (imports no runtime)."""
    if model.path is None or model.backend != "auto":
        return ("openvino" if model.backend == "auto" else model.backend,
                "model.backend names it")
    return choose_backend(model.path, model.backend, cpu_flags(),
                          importlib.util.find_spec("onnxruntime") is not None,
                          model.prompt_backend)


def choose_backend(path: Path, backend: str, cpu_flags: set[str],
                   onnxruntime_installed: bool, prompt_backend: str = "auto"
                   ) -> tuple[str, str]:
    """The runtime ``model.backend`` resolves to for the directory ``path`` on a CPU with
    ``cpu_flags``, and why (for the log and ``qvld --check``). ``auto``: the runtime
    whose graphs the directory holds; with both, ONNX Runtime for everything where its
    graphs have int8 weights and the CPU has no int8 dot products OpenVINO uses (one
    copy of the weights, measured faster there: BENCHMARKS.md, "Memory"), else
    OpenVINO (which may still prefill on ONNX Runtime: ``model.prompt_backend``)."""
    if backend != "auto":
        return backend, "model.backend names it"
    onnx = all(onnx_path(path, sub).is_file() for sub in SUBMODELS)
    ir = all(ir_path(path, sub).is_file() for sub in SUBMODELS)
    some_ir = any(ir_path(path, sub).is_file() for sub in SUBMODELS)
    if not onnx or (some_ir and not ir):  # an incomplete IR is reported, not passed over
        return "openvino", "the directory holds no complete set of ONNX graphs"
    if not some_ir:
        return "onnxruntime", "the directory holds ONNX graphs and no OpenVINO IR"
    if prompt_backend == "onnxruntime":
        return "openvino", "model.prompt_backend asks for ONNX Runtime beside OpenVINO"
    outdated = onnx_outdated(path)
    if outdated:
        return "openvino", outdated
    if onnx_weights(onnx_path(path, "language_model")) != "int8":
        return "openvino", "its ONNX graphs have float weights (no faster than the IR)"
    if not onnxruntime_installed:
        return "openvino", "onnxruntime is not installed"
    dots = sorted(cpu_flags & INT8_DOT_PRODUCTS)
    if dots:
        return "openvino", (f"the CPU has {', '.join(dots)}: OpenVINO multiplies its int8 "
                            "weights with integer dot products")
    return "onnxruntime", ("int8 ONNX graphs and a CPU without VNNI or AMX: ONNX Runtime's "
                           "integer kernels prefill and decode, one copy of the weights")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelInvalid(f"{path.name} is missing from {path.parent}") from exc
    except (OSError, ValueError) as exc:
        raise ModelInvalid(f"{path} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelInvalid(f"{path} is not a JSON object")
    return data


def find_chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str:
    """chat_template.jinja, then chat_template.json, then tokenizer_config.json."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    as_json = path / "chat_template.json"
    if as_json.is_file():
        template = _read_json(as_json).get("chat_template")
        if isinstance(template, str):
            return template
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):  # named templates: take "default"
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                return str(entry["template"])
    raise ModelInvalid(f"no chat template in {path}")


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _rgb(values: Any) -> tuple[float, float, float]:
    r, g, b = (float(v) for v in values)
    return (r, g, b)


def load_model_spec(path: Path, backend: str) -> ModelSpec:
    """The model in ``path``, which must hold the graphs ``backend`` runs (no default:
    a directory may hold one backend's graphs only, so every caller says which)."""
    if not path.is_dir():
        raise ModelInvalid(f"model directory {path} does not exist")
    graph, command = GRAPHS[backend]
    missing = [p.name for p in (graph(path, s) for s in SUBMODELS) if not p.is_file()]
    if missing:
        raise ModelInvalid(f"model directory {path} lacks {', '.join(missing)} (the "
                           f"{backend} backend's graphs: `{command}` writes them)")
    config = _read_json(path / "config.json")
    if config.get("model_type") != "qwen3_vl":
        raise ModelInvalid(f"{path}/config.json: model_type {config.get('model_type')!r}, "
                           "expected 'qwen3_vl'")
    gen = _read_json(path / "generation_config.json") if (
        path / "generation_config.json").is_file() else {}
    pre = _read_json(path / "preprocessor_config.json")
    tok_config = _read_json(path / "tokenizer_config.json")
    if not (path / "tokenizer.json").is_file():
        raise ModelInvalid(f"tokenizer.json is missing from {path}")
    try:
        text, vis = config["text_config"], config["vision_config"]
        eos = gen.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        size = pre.get("size") or {}
        vision = VisionSpec(
            patch_size=int(vis["patch_size"]),
            temporal_patch_size=int(vis["temporal_patch_size"]),
            merge_size=int(vis["spatial_merge_size"]),
            hidden_size=int(vis["hidden_size"]),
            num_heads=int(vis["num_heads"]),
            num_position_embeddings=int(vis["num_position_embeddings"]),
            deepstack_layers=len(vis["deepstack_visual_indexes"]),
            image_mean=_rgb(pre["image_mean"]),
            image_std=_rgb(pre["image_std"]),
            min_pixels=int(size.get("shortest_edge") or pre["min_pixels"]),
            max_pixels=int(size.get("longest_edge") or pre["max_pixels"]),
        )
        generation = GenerationDefaults(
            eos_token_ids=tuple(int(i) for i in eos_ids),
            do_sample=bool(gen.get("do_sample", False)),
            temperature=float(gen.get("temperature", 1.0)),
            top_k=int(gen.get("top_k", 50)),
            top_p=float(gen.get("top_p", 1.0)),
            repetition_penalty=float(gen.get("repetition_penalty", 1.0)),
        )
        specials = {
            key: name
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (name := _token_name(tok_config.get(key))) is not None
        }
        return ModelSpec(
            path=path,
            name=str(config.get("_name_or_path") or path.name),
            hidden_size=int(text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_kv_heads=int(text.get("num_key_value_heads") or text["num_attention_heads"]),
            head_dim=int(text.get("head_dim")
                         or int(text["hidden_size"]) // int(text["num_attention_heads"])),
            vocab_size=int(text["vocab_size"]),
            max_position_embeddings=int(text["max_position_embeddings"]),
            image_token_id=int(config["image_token_id"]),
            vision_start_token_id=int(config["vision_start_token_id"]),
            vision_end_token_id=int(config["vision_end_token_id"]),
            vision=vision,
            generation=generation,
            chat_template=find_chat_template(path, tok_config),
            special_tokens=specials,
            video_token_id=int(config.get("video_token_id", -1)),
            video=load_video_spec(path),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelInvalid(f"{path}: incomplete model configuration ({exc!r})") from exc
