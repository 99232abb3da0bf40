"""The streaming int8 quantiser: on the tiny model's five graphs, every quantised weight
byte for byte what onnxruntime's own ``quantize_dynamic`` makes, with the weights inline
and in an external data file; activations quantised per row, so a row's output depends
on that row alone (``quantize_dynamic``'s one scale per tensor does not), and each
MatMul computes what the row formula says."""

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


ROW_CONSTANTS = {"qvld_row_axis", "qvld_row_level", "qvld_row_one", "qvld_row_zero_point"}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("submodel", SUBMODELS)
def test_the_same_weights_as_onnxruntimes_quantiser(submodel: str, tmp_path: Path) -> None:
    src = onnx_path(TINY, submodel)
    ort_quantized(src, theirs := tmp_path / "theirs.onnx")
    quantize_graph(src, ours := tmp_path / "ours.onnx")
    expected, got = tensors(theirs), tensors(ours)
    quantised = [n for n in expected if n.endswith(("_quantized", "_scale", "_zero_point"))]
    # The two table lookups have nothing to quantise; the rest have MatMuls or Gemms.
    assert bool(quantised) == (submodel not in ("text_embeddings_model",
                                                "vision_embeddings_pos_model"))
    # Each weight's scale is kept over 127 (a row's activation scale is max|row| / 127).
    ours_of = {n: n + "_per_level" if n.endswith("_scale") else n for n in quantised}
    for name in quantised:
        want = expected[name] / np.float32(127) if name.endswith("_scale") else expected[name]
        assert got[ours_of[name]].dtype == want.dtype, name
        assert np.array_equal(got[ours_of[name]], want), name
    # and no float weight left behind; the row quantisation's constants beside them
    assert set(got) == (set(expected) - set(quantised)) | set(ours_of.values()) | (
        ROW_CONSTANTS if quantised else set())
    want, inputs = run(theirs)
    have, _ = run(ours, inputs)
    reference, _ = run(src, inputs)
    for a, b, fp32 in zip(want, have, reference, strict=True):
        if fp32.dtype == np.float32 and quantised:  # per row: at least as close to fp32
            assert cosine(b, fp32) > 0.99 and cosine(b, fp32) >= cosine(a, fp32) - 1e-3
        else:
            assert np.array_equal(a, b)
    graph = onnx.load(str(ours)).graph
    ops = [node.op_type for node in graph.node]
    assert ("MatMulIntegerToFloat" in ops) == bool(quantised)
    assert "DynamicQuantizeLinear" not in ops
    weights = {t.name for t in graph.initializer}  # every weight's MatMul is integer
    assert not [n.name for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]


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
    quantize_graph(onnx_path(TINY, "language_model"), inline := tmp_path / "inline.onnx")
    assert not inline.with_name("inline.onnx.data").exists()
    want, inputs = run(inline)
    have, _ = run(ours, inputs)
    for a, b in zip(want, have, strict=True):
        assert np.array_equal(a, b)


def lane_logits(path: Path, rows: list[int], embeds: np.ndarray,
                past: dict[str, np.ndarray], lengths: np.ndarray) -> np.ndarray:
    """The language model's next-token logits of the sequences ``rows``, stepped in one
    batch (as the decode lane steps them), each after its own ``lengths`` cached rows."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    n, length = len(rows), lengths[rows]
    feeds: dict[str, np.ndarray] = {
        "inputs_embeds": embeds[rows], "position_ids": np.tile(length[None, :, None], (3, 1, 1)),
        "visual_pos_masks": np.zeros((n, 1), bool),
        "deepstack_visual_embeds": np.zeros((2, 1, embeds.shape[-1]), np.float32),
        "seqlens_k": length.astype(np.int32),
        "total_sequence_length": np.array(length.max() + 1, np.int32)}
    for name, cache in past.items():
        feeds[name] = cache[rows].copy()  # written in place: each run its own copy
    return np.asarray(session.run(["logits"], feeds)[0])


def test_a_rows_logits_are_the_same_alone_and_in_a_batch(tmp_path: Path) -> None:
    # Three sequences of very different activations (and cache lengths) stepped
    # together and each alone: per row, the same bits; onnxruntime's per-tensor
    # quantisation (the graphs qvld exported before) gives each row the scale of the
    # largest, so the small one moves.
    src = onnx_path(TINY, "language_model")
    quantize_graph(src, ours := tmp_path / "ours.onnx")
    ort_quantized(src, theirs := tmp_path / "theirs.onnx")
    rng = np.random.default_rng(3)
    session = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    caches = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    embeds = (rng.standard_normal((3, 1, 128)) * np.array([0.05, 2.0, 40.0])[:, None, None]
              ).astype(np.float32)
    past = {i.name: rng.standard_normal((3, 2, 8, 32)).astype(np.float32) for i in caches}
    lengths = np.array([2, 5, 7], np.int64)
    for path, invariant in ((ours, True), (theirs, False)):
        together = lane_logits(path, [0, 1, 2], embeds, past, lengths)
        alone = np.concatenate([lane_logits(path, [i], embeds, past, lengths)
                                for i in range(3)])
        assert np.array_equal(together, alone) is invariant, path.name
    fp32 = np.concatenate([lane_logits(src, [i], embeds, past, lengths) for i in range(3)])
    ours_alone = np.concatenate([lane_logits(ours, [i], embeds, past, lengths)
                                 for i in range(3)])
    assert all(cosine(ours_alone[i], fp32[i]) > 0.99 for i in range(3))


def test_each_matmul_computes_the_row_formula(tmp_path: Path) -> None:
    # A Gemm with a bias and a MatMul reading the same input: q = round(a / m * 127) +
    # 128 with m = max|a| per row (an all-zero row included: its products are 0),
    # y = (q - 128) @ w_q * m * w_scale / 127 (+ bias).
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w1 = (rng.standard_normal((24, 16)) * 0.3).astype(np.float32)  # Gemm's B, transposed
    w2 = (rng.standard_normal((24, 8)) * 0.3).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w1", "bias"], ["y1"], transB=1, name="gemm"),
         helper.make_node("MatMul", ["x", "w2"], ["y2"], name="matmul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 24])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y1", "y2")],
        [numpy_helper.from_array(w1.T.copy(), "w1"), numpy_helper.from_array(w2, "w2"),
         numpy_helper.from_array(bias, "bias")])
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]),
                    str(src := tmp_path / "g.onnx"))
    quantize_graph(src, ours := tmp_path / "q.onnx")
    x = (rng.standard_normal((5, 24)) * np.array([1e-3, 1, 10, 0, 300])[:, None]
         ).astype(np.float32)
    y1, y2 = ort.InferenceSession(str(ours), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})
    absmax = np.abs(x).max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        q = np.nan_to_num(np.round(x / absmax / np.float32(1 / 127))).astype(np.int64)
    assert np.abs(q).max() == 127
    for got, weight, add in ((y1, w1, bias), (y2, w2, 0)):
        w_q, w_scale = quantize_columns(weight)
        want = (q @ w_q.astype(np.int64)).astype(np.float32) * (w_scale / np.float32(127)) \
            * absmax + add
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(y1[3], bias)  # the zero row: the bias alone
    assert not y2[3].any()


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
