"""`qvlctl model convert|info|verify`: from a checkpoint to a directory qvld serves.

Imported only when a `model` command runs: it needs the engine (info, verify) and the
`convert` extra (convert), which `qvlctl`'s other commands never load. The submodel
names are the engine's (``qvld.engine.model.model_dir.SUBMODELS``).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from qvld.engine.model.model_dir import (
    SUBMODELS,
    ir_path,
    load_model_spec,
    onnx_outdated,
    onnx_path,
    onnx_weights,
    processor_settings,
    resolve_backend,
)

# Files the engine reads besides the IRs, copied from the checkpoint.
# What the exporter may leave behind that the engine reads: the tokenizer, the chat
# template, generation defaults, and the image and video processors' settings (without
# video_preprocessor_config.json a model's clips were sampled with transformers' class
# defaults, not its own: #48).
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.json", "merges.txt", "preprocessor_config.json",
              "video_preprocessor_config.json", "processor_config.json",
              "chat_template.jinja", "chat_template.json", "generation_config.json",
              "config.json")


def _say(text: str) -> None:
    print(f"qvlctl model: {text}", file=sys.stderr, flush=True)


def resolve_source(src: str) -> Path:
    """A local checkpoint directory, or a hub id downloaded where the hub is reachable."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    _say(f"{src} is not a local directory; downloading it from the Hugging Face hub")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(src))


@dataclass(frozen=True)
class Recipe:
    """How the weights are quantised. The defaults are the ones that decode fastest here
    (BENCHMARKS.md): symmetric, one scale per output channel, and for int4 every layer
    including lm_head and the embeddings (lm_head at int8 cost 15 % of int4's speed and
    did not bring its logits closer to bf16's)."""

    weights: str = "int8"
    symmetric: bool = True
    group_size: int = -1  # -1: one scale per output channel
    ratio: float = 1.0  # int4: share of the layers in 4 bits (the rest int8)
    all_layers: bool = True  # int4: lm_head and embeddings in 4 bits too

    def quantization_options(self) -> dict[str, Any]:
        bits = 8 if self.weights == "int8" else 4
        options: dict[str, Any] = {"bits": bits, "sym": self.symmetric,
                                   "group_size": self.group_size}
        if bits == 4:
            options.update(ratio=self.ratio, all_layers=self.all_layers)
        return options

    def describe(self) -> str:
        if self.weights not in ("int8", "int4"):
            return self.weights
        groups = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        extra = ""
        if self.weights == "int4":
            extra = f", ratio {self.ratio:g}, {'all layers' if self.all_layers else 'lm_head int8'}"
        return f"{self.weights} {'sym' if self.symmetric else 'asym'} {groups}{extra}"


def export(src: Path, dst: Path, recipe: Recipe) -> None:
    """optimum-intel's export API, in this process, into ``dst`` (which must not exist)."""
    from optimum.intel import OVModelForVisualCausalLM, OVWeightQuantizationConfig

    kwargs: dict[str, Any] = {"export": True}
    if recipe.weights in ("int8", "int4"):
        kwargs["quantization_config"] = OVWeightQuantizationConfig(
            **recipe.quantization_options())
    else:
        kwargs["load_in_8bit"] = False
    model = OVModelForVisualCausalLM.from_pretrained(src, **kwargs)
    if recipe.weights == "fp16":
        model.half()
    model.save_pretrained(dst)
    copy_side_files(src, dst)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """The checkpoint's ``SIDE_FILES`` the export did not write, copied beside it."""
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def check_serves(path: Path, backend: str = "openvino", prompt_backend: str = "auto") -> str:
    """Load the result with the engine and answer one question about an image."""
    import io

    import numpy as np
    from PIL import Image

    from qvld.config import Config, EngineConfig, ModelConfig
    from qvld.engine import Engine, GenerateRequest

    engine = Engine(Config(model=ModelConfig(path=path, backend=backend,
                                             prompt_backend=prompt_backend),
                           engine=EngineConfig(infer_requests=1)))
    pixels = (np.indices((64, 96)).sum(0) % 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).convert("RGB").save(buf, "PNG")
    result = engine.generate(GenerateRequest(messages=[{"role": "user", "content": [
        {"type": "image", "image": buf.getvalue()},
        {"type": "text", "text": "What is in this picture?"}]}], max_tokens=8,
        temperature=0.0))
    return result.text


class ExportProgress:
    """What an export has done so far, on stderr: the time it has taken, the graphs
    written (of ``SUBMODELS``) and the bytes on disk, found by watching the directory it
    writes to (optimum exports into a temporary directory first: ``write_model`` puts
    that inside the partial directory, so it is watched too). On a terminal one line is
    redrawn in place; elsewhere (a log, a pipe) a line per graph and one a minute."""

    GRAPH_PATTERNS = ("openvino_*.xml", "onnx_*.onnx")

    def __init__(self, root: Path, stream: IO[str] | None = None, interval_s: float = 0.5,
                 heartbeat_s: float = 60.0) -> None:
        self.root = root
        self.stream = stream or sys.stderr
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        try:
            self.live = self.stream.isatty()
        except (AttributeError, ValueError, OSError):
            self.live = False
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="export-progress", daemon=True)
        self._t0 = time.monotonic()
        self._last_line = self._t0

    def graphs(self) -> tuple[set[str], int]:
        """The submodels with a graph written under ``root``, and the bytes written."""
        names, size = set(), 0
        for path in self.root.rglob("*"):
            try:
                if path.is_file():
                    size += path.stat().st_size
            except OSError:  # renamed or removed under us
                continue
            if any(path.match(pattern) for pattern in self.GRAPH_PATTERNS):
                stem = path.stem.split("_", 1)[-1].removesuffix(".int8")
                if stem in SUBMODELS:
                    names.add(stem)
        return names, size

    def line(self, names: set[str], size: int) -> str:
        elapsed = int(time.monotonic() - self._t0)
        state = (f"{len(names)} of {len(SUBMODELS)} graphs written" if names
                 else "loading and tracing the checkpoint")
        return (f"{elapsed // 60}:{elapsed % 60:02d} elapsed, {state}, "
                f"{size / 2**20:.0f} MiB on disk")

    def poll(self) -> None:
        names, size = self.graphs()
        now = time.monotonic()
        if self.live:
            self.stream.write(f"\r\x1b[Kqvlctl model: {self.line(names, size)}")
            self.stream.flush()
        else:
            for name in sorted(names - self.seen):
                self.say(f"{name} written ({self.line(names, size)})")
                self._last_line = now
            if now - self._last_line >= self.heartbeat_s:
                self.say(f"still exporting ({self.line(names, size)})")
                self._last_line = now
        self.seen |= names

    def say(self, text: str) -> None:
        self.stream.write(f"qvlctl model: {text}\n")
        self.stream.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def __enter__(self) -> ExportProgress:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if kind is None and not self.live:  # what the last moments wrote
            self.poll()
        if self.live:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def write_model(src: str, dst: Path, what: str, export: Callable[[Path, Path], None],
                backend: str = "openvino") -> int:
    """Export ``src`` into ``dst`` with ``export(source, directory)``, then check it
    answers on ``backend``. Everything is written beside the destination and renamed
    into place at the end: an interrupted or failed export leaves no half directory."""
    if dst.exists():
        _say(f"{dst} exists; remove it or choose another destination")
        return 2
    with exported(src, dst, what, export) as partial:
        _say("checking it answers")
        answer = check_serves(partial, backend)
        partial.rename(dst)
    where = "" if backend == "openvino" else f" with model.backend: {backend}"
    _say(f"ok: {dst} serves{where} (sample answer: {answer[:60]!r})")
    return 0


@contextmanager
def exported(src: str, dst: Path, what: str,
             export: Callable[[Path, Path], None]) -> Iterator[Path]:
    """The checkpoint ``src`` exported by ``export(source, directory)`` into a partial
    directory beside ``dst`` (same file system: its files can be renamed into place),
    with progress shown; removed on leaving unless renamed away meanwhile."""
    source = resolve_source(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        t0 = time.perf_counter()
        _say(f"exporting {source} {what}")
        # Exporters' temporary directories inside the partial one: watched for progress,
        # and removed with it if the export fails.
        scratch = partial / ".tmp"
        scratch.mkdir()
        saved_tempdir = tempfile.tempdir
        tempfile.tempdir = str(scratch)
        try:
            with ExportProgress(partial):
                export(source, partial)
        finally:
            tempfile.tempdir = saved_tempdir
        shutil.rmtree(scratch, ignore_errors=True)
        _say(f"exported in {time.perf_counter() - t0:.0f} s")
        yield partial
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def add_beside_ir(src: str, dst: Path, what: str,
                  export: Callable[[Path, Path], None]) -> int:
    """Export ONNX graphs of ``src`` into ``dst``, a directory that holds the OpenVINO IR
    of the same checkpoint, for ``model.prompt_backend``. The graphs are written beside
    ``dst`` first and must be of the IR's checkpoint (the same dimensions, and text
    embeddings that agree); they are then moved in and the directory must answer with
    images and prompts on ONNX Runtime, or they are taken out again: ``dst`` ends as it
    was or serving both ways."""
    present = sorted(p.name for p in dst.glob("onnx_*"))
    outdated = onnx_outdated(dst)
    if present and not outdated:
        _say(f"{dst} already holds ONNX graphs ({', '.join(present)}); remove them "
             "(rm DIR/onnx_*) to export them again")
        return 2
    with exported(src, dst, what, export) as partial:
        mismatch = checkpoint_mismatch(dst, partial)
        if mismatch:
            _say(f"not added: {mismatch}; export the checkpoint {dst} was converted from, "
                 "or into a new directory")
            return 2
        # Graphs an older qvld exported are replaced: kept aside until the new ones
        # serve, put back if they do not.
        before = partial / ".before"
        before.mkdir()
        if outdated:
            _say(f"replacing the graphs an older qvld exported ({', '.join(present)})")
        for name in present:
            (dst / name).rename(before / name)
        moved: list[Path] = []
        try:
            for graph in sorted(partial.glob("onnx_*")):
                graph.rename(dst / graph.name)
                moved.append(dst / graph.name)
            _say("checking it answers with images and prompts on ONNX Runtime")
            answer = check_serves(dst, prompt_backend="onnxruntime")
        except BaseException:
            for path in moved:  # the directory as it was
                path.unlink(missing_ok=True)
            for name in present:
                (before / name).rename(dst / name)
            raise
    auto = onnx_weights(onnx_path(dst, "language_model")) == "int8"
    from qvld.config import ModelConfig

    runtime, why = resolve_backend(ModelConfig(path=dst))
    _say(f"ok: {dst} serves with images and prompts on ONNX Runtime (sample answer: "
         f"{answer[:60]!r}); " + (f"model.backend auto runs {runtime} here: {why}" +
                                  ("; model.prompt_backend: auto uses them"
                                   if runtime == "openvino" else "") if auto else
                                  "auto uses int8 graphs only: set model.prompt_backend: "
                                  "onnxruntime to use these"))
    return 0


def checkpoint_mismatch(ir_dir: Path, onnx_dir: Path) -> str | None:
    """Why the ONNX graphs in ``onnx_dir`` are not of the checkpoint ``ir_dir``'s IR was
    made from, or None: the models' dimensions, then the text embeddings of tokens across
    the vocabulary (weights are compared without loading the large graphs). Rows of
    unrelated checkpoints are near orthogonal (|cosine| < 0.1 in 2048 dimensions); one
    checkpoint's rows quantised per row to 4 bits still agree at about 0.97-0.99 with
    outliers in the row, so the bar is 0.9. A fine-tune of the IR's checkpoint may pass."""
    import numpy as np
    import onnxruntime as ort
    import openvino as ov

    dims = ("hidden_size", "num_layers", "num_kv_heads", "head_dim", "vocab_size")
    ir_spec = load_model_spec(ir_dir, "openvino")
    onnx_spec = load_model_spec(onnx_dir, "onnxruntime")
    differ = [f"{d} {getattr(ir_spec, d)} vs {getattr(onnx_spec, d)}" for d in dims
              if getattr(ir_spec, d) != getattr(onnx_spec, d)]
    if differ or ir_spec.vision != onnx_spec.vision:
        return "the models' dimensions differ (" + (", ".join(differ) or "vision") + ")"
    ids = np.linspace(0, ir_spec.vocab_size - 1, 64).astype(np.int64).reshape(1, -1)
    compiled = ov.Core().compile_model(ir_path(ir_dir, "text_embeddings_model"), "CPU",
                                       {"INFERENCE_PRECISION_HINT": "f32"})
    ir_rows = np.asarray(compiled(ids)[0])[0]
    session = ort.InferenceSession(str(onnx_path(onnx_dir, "text_embeddings_model")),
                                   providers=["CPUExecutionProvider"])
    onnx_rows = np.asarray(session.run(None, {"input": ids})[0])[0]
    cosine = (ir_rows * onnx_rows).sum(-1) / np.maximum(
        np.linalg.norm(ir_rows, axis=-1) * np.linalg.norm(onnx_rows, axis=-1), 1e-12)
    if float(cosine.min()) < 0.9:
        return (f"the text embeddings differ (cosine {float(cosine.min()):.3f} at worst "
                "over 64 tokens): another checkpoint's weights")
    return None


def convert(src: str, dst: Path, recipe: Recipe) -> int:
    return write_model(src, dst, f"with {recipe.describe()} weights",
                       lambda source, out: export(source, out, recipe))


def weight_formats(xml: Path) -> dict[str, int]:
    """Bytes of constants per element type in one IR (where the weights are)."""
    import openvino as ov

    sizes: Counter[str] = Counter()
    for node in ov.Core().read_model(xml).get_ordered_ops():
        if node.get_type_name() == "Constant":
            output = node.get_output_element_type(0)
            shape = node.get_output_shape(0)
            count = 1
            for dim in shape:
                count *= int(dim)
            sizes[output.get_type_name()] += count * output.bitwidth // 8
    return dict(sizes.most_common())


def language_layout(path: Path) -> str:
    import openvino as ov

    from qvld.engine.model.openvino import weight_layout

    layout = weight_layout(ov.Core().read_model(path / "openvino_language_model.xml"))
    return str(layout) if layout else "float"


def graph_formats(graph: Path) -> dict[str, int]:
    """Bytes of initialisers per element type in one ONNX graph (without loading them)."""
    import onnx

    sizes: Counter[str] = Counter()
    for tensor in onnx.load(str(graph), load_external_data=False).graph.initializer:
        info = {entry.key: entry.value for entry in tensor.external_data}
        count = 1
        for dim in tensor.dims:
            count *= int(dim)
        np_type = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        size = int(info["length"]) if "length" in info else count * np_type.itemsize
        sizes[onnx.TensorProto.DataType.Name(tensor.data_type).lower()] += size
    return dict(sizes.most_common())


def backend_of(path: Path) -> str:
    """The backend a directory's graphs are for: OpenVINO IRs first, then ONNX graphs."""
    from qvld.engine.model.model_dir import ir_path, onnx_path

    if not ir_path(path, "language_model").is_file() and \
            onnx_path(path, "language_model").is_file():
        return "onnxruntime"
    return "openvino"


def info(path: Path) -> dict[str, Any]:
    from qvld.engine.model.model_dir import load_model_spec, onnx_path
    from qvld.errors import ModelInvalid

    document: dict[str, Any] = {"path": str(path)}
    backend = backend_of(path)
    try:
        spec = load_model_spec(path, backend)
    except ModelInvalid as exc:
        document.update(loadable=False, error=str(exc))
        return document
    config = json.loads((path / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    document.update({
        "model_type": config.get("model_type"),
        "text": {k: text.get(k) for k in ("hidden_size", "num_hidden_layers",
                                          "num_attention_heads", "num_key_value_heads",
                                          "head_dim", "vocab_size",
                                          "max_position_embeddings")},
        "vision": {k: vision.get(k) for k in ("depth", "hidden_size", "num_heads",
                                              "patch_size", "spatial_merge_size",
                                              "deepstack_visual_indexes")},
        "image_pixels": {"min": spec.vision.min_pixels, "max": spec.vision.max_pixels},
        "chat_template": bool(spec.chat_template),
        # What pictures and clips are processed with, and where each value came from.
        "processor": [{"setting": key, "value": value, "from": source}
                      for key, value, source in processor_settings(path)],
        "size_bytes": sum(p.stat().st_size for p in path.iterdir() if p.is_file()),
        "backend": backend,
    })
    if backend == "openvino":
        document["weights"] = {sub: weight_formats(path / f"openvino_{sub}.xml")
                               for sub in SUBMODELS}
        document["language_model_layout"] = language_layout(path)
    else:
        import onnx

        document["weights"] = {sub: graph_formats(onnx_path(path, sub)) for sub in SUBMODELS}
        lm = onnx.load(str(onnx_path(path, "language_model")), load_external_data=False)
        document["language_model_layout"] = {
            p.key: p.value for p in lm.metadata_props}.get("qvld.weights", "unknown")
    try:
        from qvld.config import Config, EngineConfig, ModelConfig
        from qvld.engine import Engine

        Engine(Config(model=ModelConfig(path=path, backend=backend),
                      engine=EngineConfig(infer_requests=1)))
        document["loadable"] = True
    except Exception as exc:  # what the engine says is the answer here
        document.update(loadable=False, error=str(exc))
    return document


def render_info(document: dict[str, Any]) -> str:
    if "text" not in document:
        return f"{document['path']}: not a Qwen3-VL export: {document.get('error')}"
    text, vision = document["text"], document["vision"]
    lines = [
        f"path:          {document['path']}",
        f"model type:    {document['model_type']}",
        f"text:          hidden {text['hidden_size']}, {text['num_hidden_layers']} layers, "
        f"{text['num_attention_heads']}/{text['num_key_value_heads']} heads, vocab "
        f"{text['vocab_size']}",
        f"vision:        depth {vision['depth']}, hidden {vision['hidden_size']}, patch "
        f"{vision['patch_size']}, deepstack {vision['deepstack_visual_indexes']}",
        f"image pixels:  {document['image_pixels']['min']}..{document['image_pixels']['max']}",
        f"chat template: {'yes' if document['chat_template'] else 'no'}",
        f"size on disk:  {document['size_bytes'] / 2**20:.1f} MiB",
        f"backend:       {document['backend']}",
        f"LM weights:    {document['language_model_layout']}",
    ]
    lines.append("processor:")
    lines += [f"  {row['setting']:<28} {row['value']!s:<20} {row['from']}"
              for row in document["processor"]]
    for sub, formats in document["weights"].items():
        total = sum(formats.values()) or 1
        shares = ", ".join(f"{t} {b / total:.0%}" for t, b in formats.items() if b / total > 0.01)
        lines.append(f"  {sub:<32} {shares}")
    lines.append(f"loadable:      {'yes' if document['loadable'] else 'no: ' + document['error']}")
    return "\n".join(lines)


def verify(path: Path, reference: Path | None, backend: str = "openvino") -> dict[str, Any]:
    """Run the reference cases at f32 and count exactly matching token ids."""
    from qvld.config import Config, EngineConfig, ModelConfig
    from qvld.engine import Engine, GenerateRequest

    reference = reference or path / "reference.json"
    cases = json.loads(reference.read_text())["cases"]
    engine = Engine(Config(model=ModelConfig(path=path, precision="f32",
                                             kv_cache_precision="f32", backend=backend),
                           engine=EngineConfig(infer_requests=1)))
    images = reference.parent / "images"
    exact = tokens = agree = 0
    rows = []
    for case in cases:
        messages = []
        for message in case["messages"]:
            content = message["content"]
            if isinstance(content, list):
                content = [{"type": "image", "image": (images / p["image"]).read_bytes()}
                           if p["type"] == "image" else p for p in content]
            messages.append({**message, "content": content})
        got = engine.generate(GenerateRequest(messages=messages, temperature=0.0,
                                              max_tokens=case["max_new_tokens"])).token_ids
        want = case["token_ids"]
        same = sum(1 for a, b in zip(got, want, strict=False) if a == b)
        exact += got == want
        agree += same
        tokens += len(want)
        rows.append({"name": case["name"], "exact": got == want, "agreeing": same,
                     "tokens": len(want)})
    return {"cases": len(cases), "exact": exact, "token_agreement": agree / max(tokens, 1),
            "results": rows}
