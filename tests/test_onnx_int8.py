"""The streaming int8 quantiser against onnxruntime's own ``quantize_dynamic``: on the tiny
model's five graphs, every quantised tensor byte for byte and every output equal, with
the weights inline and in an external data file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qvld.engine.model.model_dir import SUBMODELS, onnx_path
from qvld.modeltools.onnx_int8 import quantize_columns, quantize_graph
from tests.conftest import TINY

# Sizes for the graphs' named dynamic axes (a 4-patch merge block; 3 new rows after 2
# cached ones in a cache buffer of 8).
AXES = {"batch": 1, "seq": 3, "capacity": 8, "visual_rows": 1, "patches": 16, "tokens": 4}
PAST, SEQ = 2, 3


def ort_quantized(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, dst, weight_type=QuantType.QInt8, per_channel=True,
                     reduce_range=True, op_types_to_quantize=["MatMul", "Gemm"])


def feeds(session: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else AXES[d] for d in spec.shape]
        if spec.name == "seqlens_k":
            out[spec.name] = np.array([PAST + SEQ - 1], np.int32)
        elif spec.name == "total_sequence_length":
            out[spec.name] = np.array(PAST + SEQ, np.int32)
        elif spec.name == "visual_pos_masks":
            out[spec.name] = np.array([[False, True, False]])
        elif spec.type == "tensor(int64)":
            out[spec.name] = rng.integers(0, 4, shape).astype(np.int64)
        else:
            out[spec.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def run(path: Path, inputs: dict[str, np.ndarray] | None = None
        ) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = inputs if inputs is not None else feeds(session, np.random.default_rng(0))
    return session.run(None, inputs), inputs


def tensors(path: Path) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("submodel", SUBMODELS)
def test_the_same_model_as_onnxruntimes_quantiser(submodel: str, tmp_path: Path) -> None:
    src = onnx_path(TINY, submodel)
    ort_quantized(src, theirs := tmp_path / "theirs.onnx")
    quantize_graph(src, ours := tmp_path / "ours.onnx")
    expected, got = tensors(theirs), tensors(ours)
    quantised = [n for n in expected if n.endswith(("_quantized", "_scale", "_zero_point"))]
    # The two table lookups have nothing to quantise; the rest have MatMuls or Gemms.
    assert bool(quantised) == (submodel not in ("text_embeddings_model",
                                                "vision_embeddings_pos_model"))
    for name in quantised:
        assert got[name].dtype == expected[name].dtype, name
        assert np.array_equal(got[name], expected[name]), name
    assert set(got) == set(expected)  # and no float weight left behind
    want, inputs = run(theirs)
    have, _ = run(ours, inputs)
    for a, b in zip(want, have, strict=True):
        assert np.array_equal(a, b)
    ops = {node.op_type for node in onnx.load(str(ours)).graph.node}
    assert ("MatMulInteger" in ops) == bool(quantised)


def test_external_data_is_read_and_written_a_tensor_at_a_time(tmp_path: Path) -> None:
    # The language model with every tensor in one external file, as large graphs are.
    src = tmp_path / "lm" / "model.onnx"
    src.parent.mkdir()
    model = onnx.load(str(onnx_path(TINY, "language_model")))
    onnx.save_model(model, str(src), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    quantize_graph(src, ours := tmp_path / "ours.onnx")
    data = ours.with_name("ours.onnx.data")
    assert data.stat().st_size > 0
    stored = onnx.load(str(ours), load_external_data=False).graph.initializer
    external = [t for t in stored if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(
        int({e.key: e.value for e in t.external_data}["offset"]) % 4096 == 0 for t in external)
    ort_quantized(onnx_path(TINY, "language_model"), theirs := tmp_path / "theirs.onnx")
    want, inputs = run(theirs)
    have, _ = run(ours, inputs)
    for a, b in zip(want, have, strict=True):
        assert np.array_equal(a, b)


def test_columns_are_scaled_by_their_own_largest_magnitude() -> None:
    weight = np.array([[1.0, -0.5, 0.0], [-2.0, 0.25, 0.0]], np.float32)
    values, scale = quantize_columns(weight)
    assert scale.tolist() == pytest.approx([2 / 64, 0.5 / 64, 1.0])  # 1.0: an all-zero column
    assert values[:, 0].tolist() == [32, -64] and values[:, 1].tolist() == [-64, 32]
    assert values[:, 2].tolist() == [0, 0]


def test_a_tall_weight_quantised_in_blocks_equals_onnxruntimes_per_channel_math() -> None:
    from onnx import TensorProto
    from onnxruntime.quantization.quant_utils import quantize_data

    rng = np.random.default_rng(1)
    weight = (rng.standard_normal((1000, 37)) * rng.uniform(0.01, 3, 37)).astype(np.float32)
    weight[:, 5] = 0.0
    values, scale = quantize_columns(weight)  # 1000 rows: four blocks
    for column in range(weight.shape[1]):
        zero, their_scale, theirs = quantize_data(weight[:, column], TensorProto.INT8,
                                                  symmetric=True, reduce_range=True)
        assert zero == 0 and np.float32(their_scale) == scale[column], column
        assert np.array_equal(values[:, column], theirs), column
