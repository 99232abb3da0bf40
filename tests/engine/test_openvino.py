"""The OpenVINO backend's reading of compressed weights and the settings it derives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest
from qvld.engine.model.backend import release_file_pages
from qvld.engine.model.openvino import (
    WeightLayout,
    auto_dynamic_quantization,
    auto_precision,
    compile_properties,
    patch_embedding_as_matmul,
    weight_layout,
)


def compressed_matmul(dtype: str, group: int, zero_point: bool) -> ov.Model:
    """x[1,64] @ W^T with W stored as NNCF stores it: integers -> Convert [-> Subtract]
    -> Multiply by scales [-> Reshape from groups]."""
    rng = np.random.default_rng(0)
    out, inp = 32, 64
    shape = [out, inp // group, group] if group > 0 else [out, inp]
    tensor = ov.Tensor(getattr(ov.Type, dtype), shape)  # ov.Type("i8") would be numpy's int64
    data = tensor.data  # 4-bit types come as packed bytes: any byte is two valid nibbles
    data.reshape(-1).view(np.uint8)[:] = rng.integers(0, 256, size=data.nbytes, dtype=np.uint8)
    weights = ops.constant(tensor)
    value = ops.convert(weights, "f32")
    scale_shape = [*shape[:-1], 1]
    if zero_point:
        value = ops.subtract(value, ops.constant(np.full(scale_shape, 3, np.float32)))
    value = ops.multiply(value, ops.constant(np.full(scale_shape, 0.01, np.float32)))
    if group > 0:
        value = ops.reshape(value, ops.constant(np.array([out, inp], np.int64)), False)
    x = ops.parameter([1, inp], np.float32, name="x")
    return ov.Model([ops.matmul(x, value, False, True)], [x])


@pytest.mark.parametrize(("dtype", "group", "zero_point", "expected"), [
    ("i8", -1, False, WeightLayout(8, True, -1)),
    ("u8", -1, True, WeightLayout(8, False, -1)),
    ("i4", 16, False, WeightLayout(4, True, 16)),
    ("u4", 32, True, WeightLayout(4, False, 32)),
    ("i4", -1, False, WeightLayout(4, True, -1)),
])
def test_weight_layout_reads_how_weights_are_stored(dtype: str, group: int, zero_point: bool,
                                                    expected: WeightLayout) -> None:
    model = compressed_matmul(dtype, group, zero_point)
    assert weight_layout(model) == expected
    # The model runs: the layout is read from a graph the CPU plugin accepts.
    compiled = ov.Core().compile_model(model, "CPU")
    assert compiled({"x": np.ones((1, 64), np.float32)})[0].shape == (1, 32)


def test_float_weights_have_no_layout(tiny_dir: Path) -> None:
    assert weight_layout(ov.Core().read_model(tiny_dir / "openvino_language_model.xml")) is None


def test_auto_dynamic_quantization_follows_the_weights() -> None:
    assert auto_dynamic_quantization(WeightLayout(8, True, -1)) == 128
    assert auto_dynamic_quantization(WeightLayout(8, False, -1)) == 128
    assert auto_dynamic_quantization(WeightLayout(4, True, 64)) == 64
    assert auto_dynamic_quantization(WeightLayout(4, True, -1)) == 128
    assert auto_dynamic_quantization(None) is None


def test_auto_precision_is_f32_only_for_a_compressed_language_model() -> None:
    int8 = WeightLayout(8, True, -1)
    assert auto_precision(int8, language=True) == "f32"
    assert auto_precision(int8, language=False) is None  # vision: bf16 where AMX helps
    assert auto_precision(None, language=True) is None
    settings = compile_properties(ModelConfig(path=Path(".")), EngineConfig(), int8,
                                  language=True)
    assert settings["INFERENCE_PRECISION_HINT"] == "f32"
    assert settings["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 128
    explicit = compile_properties(ModelConfig(path=Path("."), precision="bf16",
                                              dynamic_quantization="off"),
                                  EngineConfig(), int8, language=True)
    assert explicit["INFERENCE_PRECISION_HINT"] == "bf16"
    assert explicit["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 0


def test_runtime_reports_the_weights_it_serves(tiny_dir: Path) -> None:
    engine = Engine(Config(model=ModelConfig(path=tiny_dir), engine=EngineConfig(
        infer_requests=1)))
    assert engine.models.runtime_properties["WEIGHTS"] == "float"
    assert engine.models.weight_layout is None


def test_patch_embedding_runs_as_a_matmul_with_the_same_result(tiny_dir: Path) -> None:
    path = tiny_dir / "openvino_vision_embeddings_model.xml"
    core = ov.Core()
    original, rewritten = core.read_model(path), core.read_model(path)
    assert patch_embedding_as_matmul(rewritten)
    kinds = {n.get_type_name() for n in rewritten.get_ordered_ops()}
    assert "Convolution" not in kinds and "MatMul" in kinds
    conv = next(n for n in original.get_ordered_ops() if n.get_type_name() == "Convolution")
    width = int(np.prod([int(d) for d in conv.get_input_shape(1)][1:]))  # 3 x 2 x p x p
    rows = np.random.default_rng(0).standard_normal((37, width)).astype(np.float32)
    f32 = {"INFERENCE_PRECISION_HINT": "f32"}
    want = core.compile_model(original, "CPU", f32)({0: rows})[0]
    got = core.compile_model(rewritten, "CPU", f32)({0: rows})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Anything else is left alone.
    assert not patch_embedding_as_matmul(compressed_matmul("i8", -1, False))


def test_the_engine_serves_the_rewritten_patch_embedding(tiny_dir: Path) -> None:
    engine = Engine(Config(model=ModelConfig(path=tiny_dir), engine=EngineConfig(
        infer_requests=1)))
    assert engine.models.patch_matmul


def resident_bytes(files: set[str]) -> int:
    """Rss of this process's mappings of ``files`` (from /proc/self/smaps)."""
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            current = len(fields) >= 6 and fields[5] in files
        elif current and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_mapped_weight_pages_are_released_and_answers_unchanged(tiny_dir: Path) -> None:
    engine = Engine(Config(model=ModelConfig(path=tiny_dir, precision="f32",
                                             kv_cache_precision="f32"),
                           engine=EngineConfig(infer_requests=1)))
    request = GenerateRequest(messages=[{"role": "user", "content": "Count to five."}],
                              max_tokens=8, temperature=0.0)
    before = engine.generate(request).token_ids
    files = engine.models.weight_files
    assert resident_bytes(files) > 0, "the IR's weights are not mapped: nothing to test"
    assert release_file_pages(files) > 0
    assert resident_bytes(files) == 0
    assert engine.generate(request).token_ids == before
    engine.warmup()  # which releases them too
    assert resident_bytes(files) == 0


def test_blobs_from_the_model_cache_are_released_too(tiny_dir: Path, tmp_path: Path) -> None:
    def load() -> Engine:
        return Engine(Config(model=ModelConfig(path=tiny_dir, cache_dir=tmp_path),
                             engine=EngineConfig(infer_requests=1)))

    load()  # fills the cache
    engine = load()  # served from it
    blobs = {str(p.resolve()) for p in tmp_path.glob("*/*.blob")}  # in the keyed subdirectory
    assert blobs and blobs <= engine.models.weight_files
    engine.warmup()
    assert resident_bytes(engine.models.weight_files) == 0
