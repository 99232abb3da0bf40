"""Int8 weights for an ONNX graph, one tensor in memory at a time, and activations
quantised per row.

Each Gemm (alpha = beta = 1, A not transposed) becomes a MatMul (its weight transposed)
and an Add of its bias; each MatMul whose B is a weight becomes::

    Abs(A) -> ReduceMax(last axis)                         -> A_absmax [..., 1]
    QuantizeLinear(A / A_absmax, 1/127, 128)                -> A_q (u8)
    com.microsoft.MatMulIntegerToFloat(A_q, W_q, 1, W_scale / 127, 128, W_zero_point)
        * A_absmax                                          -> the MatMul's output

(the quantisation shared by every MatMul that reads A). Each row of A (a token, a
patch) gets its own scale, max|row| / 127, symmetric around the fixed zero point 128: a
row's integer product (exact, in int32) and its scaling depend on that row alone, so a
batched step gives every sequence in it the logits it gets alone, and a prompt's rows
the same whatever chunks it is fed in. onnxruntime's ``quantize_dynamic`` (what qvld
exported before) quantises a whole tensor with one scale: one sequence's activations
moved another's. Its fused per-tensor kernel (DynamicQuantizeMatMul) takes no row
scale; MatMulIntegerToFloat takes only a scalar zero point for A, hence symmetric rows.

The fastest form measured (``bench/quantised_matmul.py``; BENCHMARKS.md, "Batched
answers equal alone answers"): the 1/127 lives in the weights' scales and a row is
divided by its largest magnitude directly (a row of zeros: 0/0, whatever its u8 values
are its scale 0 makes its products 0), and the row scale multiplies the GEMM's output in
a Mul, which ONNX Runtime spreads over its threads. MatMulIntegerToFloat also takes a
column of row scales, but then scales its output on one thread: a prompt's rows took
8 % longer than per tensor.

``W_q`` is the weight's int8 values per output channel as ``quantize_dynamic`` makes
them with the options the export has always used (``weight_type=QInt8,
per_channel=True, reduce_range=True``): symmetric, 7 bits, scale = max|w| / 64 per
column, values rounded half to even; ``tests/test_onnx_int8.py`` holds every quantised
weight to onnxruntime's byte for byte (and each scale, over 127, to its).

What differs from ``quantize_dynamic`` in memory: it holds the float model, a copy
saved and reloaded for shape inference, and the quantised tensors at once (21.4 GB for
the full-size language model). Here the graph is read without its tensors, and each
weight is read from the external data file, quantised and written out before the next
one is read: the peak is the largest weight (the 1.2 GB output projection of the
full-size model) and its int8 copy.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Page-aligned tensors in the data file: the runtime maps it.
ALIGN = 4096
# Tensors this small are kept inside the graph file (as onnx's savers do).
INLINE_BYTES = 1024
QMIN, QMAX = -64, 64  # int8 with reduce_range: 7 bits, symmetric
# Activations: symmetric per row, u8 around a fixed zero point (a row's values to
# [1, 255]); 7-bit weights keep AVX2's saturating u8 x s8 pair sums in range.
ROW_LEVELS = 127
ROW_ZERO_POINT = 128
ROWS_PER_BLOCK = 256
EXTERNAL_OVER = 64 << 20  # a graph file larger than this gets an external data file


def quantize_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 values and float32 scales of ``weight`` [K, N], per column (the MatMul's
    output channels), as onnxruntime computes them."""
    weight = np.asarray(weight, dtype=np.float32)
    absmax = np.maximum(np.abs(np.minimum(weight.min(axis=0), 0)),
                        np.abs(np.maximum(weight.max(axis=0), 0)))
    # The range in float64, as onnxruntime's compute_scale_zp: 2 * absmax / (qmax - qmin).
    scale64 = (absmax.astype(np.float64) * 2) / float(QMAX - QMIN)
    scale = scale64.astype(np.float32)
    scale[scale64 < np.finfo(np.float32).tiny] = 1.0  # an all-zero column
    # In blocks of rows: float temporaries of a block, not of the whole weight.
    values = np.empty(weight.shape, np.int8)
    for start in range(0, weight.shape[0], ROWS_PER_BLOCK):
        block = weight[start:start + ROWS_PER_BLOCK] / scale[None, :]
        np.round(block, out=block)
        np.clip(block, -128, 127, out=block)
        values[start:start + ROWS_PER_BLOCK] = block
    return values, scale


@dataclass
class TensorSource:
    """Where a graph's initialisers live: inline in the proto, or in its data file."""

    graph_dir: Path
    inline: dict[str, Any] = field(default_factory=dict)

    def read(self, tensor: Any) -> np.ndarray:
        import onnx
        from onnx import numpy_helper

        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            return np.asarray(numpy_helper.to_array(tensor))
        info = {entry.key: entry.value for entry in tensor.external_data}
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        with (self.graph_dir / info["location"]).open("rb") as f:
            f.seek(int(info.get("offset", 0)))
            data = np.fromfile(f, dtype=dtype, count=count)
        return data.reshape(tuple(tensor.dims))


class DataWriter:
    """The output's data file: tensors appended page-aligned, small ones left inline."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.file = path.open("wb") if path is not None else None

    def put(self, name: str, array: np.ndarray) -> Any:
        from onnx import numpy_helper

        array = np.ascontiguousarray(array)
        if self.file is None or self.path is None or array.nbytes < INLINE_BYTES:
            return numpy_helper.from_array(array, name)
        return self.put_bytes(name, array.dtype, array.shape, array.tobytes())

    def put_bytes(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...],
                  blob: bytes | memoryview) -> Any:
        return self.put_chunks(name, dtype, shape, iter((blob,)))

    def put_chunks(self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...],
                   chunks: Iterator[bytes | memoryview]) -> Any:
        import onnx

        assert self.file is not None and self.path is not None
        tensor = onnx.TensorProto()
        tensor.name = name
        tensor.data_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        tensor.dims.extend(shape)
        self.file.write(b"\0" * (-self.file.tell() % ALIGN))
        offset = self.file.tell()
        for chunk in chunks:
            self.file.write(chunk)
        length = self.file.tell() - offset
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(offset)),
                           ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        return tensor

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _attributes(node: Any) -> dict[str, Any]:
    import onnx

    return {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}


def _gemms_as_matmuls(graph: Any, initializers: dict[str, Any],
                      transposed: dict[str, str]) -> list[Any]:
    """Each plain Gemm as MatMul (+ Add of its bias), as onnxruntime rewrites them before
    quantising; a transposed weight is noted by name (its new name -> its own), and read
    and transposed only when it is quantised."""
    import onnx

    nodes: list[Any] = []
    for node in graph.node:
        attrs = _attributes(node) if node.op_type == "Gemm" else {}
        if node.op_type != "Gemm" or attrs.get("alpha", 1.0) != 1.0 \
                or attrs.get("beta", 1.0) != 1.0 or attrs.get("transA", 0) != 0:
            nodes.append(node)
            continue
        weight = node.input[1]
        if attrs.get("transB", 0) == 1:
            if weight in initializers:
                transposed[weight + "_Transposed"] = weight
                weight += "_Transposed"
            else:
                nodes.append(onnx.helper.make_node("Transpose", [weight], [weight + "_Transposed"],
                                                   name=node.name + "_Transpose"))
                weight += "_Transposed"
        biased = len(node.input) > 2
        product = node.output[0] + ("_MatMul" if biased else "")
        nodes.append(onnx.helper.make_node("MatMul", [node.input[0], weight], [product],
                                           name=node.name + "_MatMul" if node.name else ""))
        if biased:
            nodes.append(onnx.helper.make_node("Add", [product, node.input[2]],
                                               list(node.output),
                                               name=node.name + "_Add" if node.name else ""))
    return nodes


def quantize_graph(src: Path, dst: Path, say: Any = None) -> None:
    """Write ``dst`` (and ``dst.data`` when ``src`` has external data): ``src`` with its
    MatMul and Gemm weights in int8, as described in the module docstring."""
    import onnx

    proto = onnx.load(str(src), load_external_data=False)
    graph = proto.graph
    source = TensorSource(src.parent)
    initializers = {t.name: t for t in graph.initializer}
    transposed: dict[str, str] = {}
    nodes = _gemms_as_matmuls(graph, initializers, transposed)
    weights: dict[str, str] = {}  # float weight -> its int8 name
    quantized_inputs: set[str] = set()
    out_nodes: list[Any] = []
    for node in nodes:
        b = node.input[1] if node.op_type == "MatMul" else ""
        if not b or (b not in initializers and b not in transposed):
            out_nodes.append(node)
            continue
        a = node.input[0]
        if a not in quantized_inputs:
            quantized_inputs.add(a)
            out_nodes += _quantize_rows(a, _opset(proto))
        weights.setdefault(b, b + "_quantized")
        name = node.name or node.output[0]
        out_nodes += [
            onnx.helper.make_node(
                "MatMulIntegerToFloat",
                [a + "_quantized", b + "_quantized", _ONE, b + "_scale_per_level",
                 _ZERO_POINT, b + "_zero_point"],
                [node.output[0] + "_per_level"], name + "_quant", domain="com.microsoft"),
            onnx.helper.make_node("Mul", [node.output[0] + "_per_level", a + "_absmax"],
                                  list(node.output), name + "_row_scale")]
    if weights:
        graph.initializer.extend(_row_constants())
        initializers = {t.name: t for t in graph.initializer}
        if not any(op.domain == "com.microsoft" for op in proto.opset_import):
            proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    used = {name for node in out_nodes for name in node.input}
    # Out of the graph file when large: a graph saved with its tensors inside is held
    # (and copied by protobuf) whole when written.
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer) \
        or src.stat().st_size > EXTERNAL_OVER
    writer = DataWriter(dst.with_name(dst.name + ".data") if external else None)
    kept: list[Any] = []
    try:
        for name, tensor in initializers.items():
            if name in used:  # a float tensor still read (biases, norms, tables)
                kept.append(_copy(tensor, source, writer))
        for i, (weight, q_name) in enumerate(weights.items()):
            if say is not None and external:
                say(f"  {src.name}: {i + 1}/{len(weights)} {weight}")
            w = source.read(initializers[transposed[weight]]).T if weight in transposed \
                else source.read(initializers[weight])
            values, scale = quantize_columns(w)
            del w
            kept += [writer.put(q_name, values),
                     writer.put(weight + "_scale_per_level", scale / np.float32(ROW_LEVELS)),
                     writer.put(weight + "_zero_point", np.zeros(scale.shape, np.int8))]
    finally:
        writer.close()
    del graph.initializer[:]
    graph.initializer.extend(kept)
    del graph.node[:]
    graph.node.extend(out_nodes)
    onnx.save_model(proto, str(dst))


# The constants every row quantisation reads (initialisers of the quantised graph).
_AXIS, _LEVEL, _ONE, _ZERO_POINT = ("qvld_row_axis", "qvld_row_level", "qvld_row_one",
                                    "qvld_row_zero_point")


def _row_constants() -> list[Any]:
    from onnx import numpy_helper

    return [numpy_helper.from_array(np.array([-1], np.int64), _AXIS),
            numpy_helper.from_array(np.array(1 / ROW_LEVELS, np.float32), _LEVEL),
            numpy_helper.from_array(np.array(1.0, np.float32), _ONE),
            numpy_helper.from_array(np.array(ROW_ZERO_POINT, np.uint8), _ZERO_POINT)]


def _opset(proto: Any) -> int:
    return next((int(op.version) for op in proto.opset_import if op.domain in ("", "ai.onnx")),
                1)


def _quantize_rows(a: str, opset: int) -> list[Any]:
    """``a``'s rows in u8, each with its own scale: ``a_quantized``, and ``a_absmax``
    (the scale times 127, which the weights' scales carry).

    The row over its largest magnitude is rounded and shifted by one QuantizeLinear
    with a scalar scale (onnxruntime's vectorised, threaded path; its per-axis and
    blocked forms are scalar loops)."""
    import onnx

    make = onnx.helper.make_node
    # ReduceMax takes its axes as an input from opset 18, as an attribute before.
    reduce = (make("ReduceMax", [a + "_abs", _AXIS], [a + "_absmax"], a + "_RowMax", keepdims=1)
              if opset >= 18 else
              make("ReduceMax", [a + "_abs"], [a + "_absmax"], a + "_RowMax", axes=[-1],
                   keepdims=1))
    return [
        make("Abs", [a], [a + "_abs"], a + "_RowAbs"),
        reduce,
        make("Div", [a, a + "_absmax"], [a + "_unit"], a + "_RowUnit"),
        make("QuantizeLinear", [a + "_unit", _LEVEL, _ZERO_POINT], [a + "_quantized"],
             a + "_QuantizeLinear"),
    ]


def _copy(tensor: Any, source: TensorSource, writer: DataWriter) -> Any:
    """A float initialiser as it is, its bytes moved to the output's data file in chunks."""
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL or writer.file is None:
        return writer.put(tensor.name, source.read(tensor))
    info = {entry.key: entry.value for entry in tensor.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return writer.put_chunks(tensor.name, dtype, tuple(tensor.dims),
                             _chunks(source.graph_dir / info["location"],
                                     int(info.get("offset", 0)), int(info["length"])))


def _chunks(path: Path, offset: int, length: int, size: int = 64 << 20) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(offset)
        while length > 0:
            piece = f.read(min(size, length))
            if not piece:
                raise OSError(f"{path} ends before its tensors do")
            length -= len(piece)
            yield piece


def main(argv: list[str] | None = None) -> int:
    """``python -m qvld.modeltools.onnx_int8 SRC DST``: one graph (for measuring)."""
    args = sys.argv[1:] if argv is None else argv
    quantize_graph(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
