"""What quantising each row's activations costs against one scale per tensor, with no
model around it: layers of Qwen3-VL-2B's language-model MatMuls (hidden 2048, KV 1024,
MLP 6144; norms and residual adds between them), random weights, run by ONNX Runtime.

    python bench/quantised_matmul.py [--layers 2] [--rows 1,8,512] [--repeats 21]
    valgrind --tool=callgrind python bench/quantised_matmul.py --rows 8 --runs 1 --only row
    valgrind --tool=callgrind python bench/quantised_matmul.py --rows 8 --runs 11 --only row

The same float graph is quantised by qvld's ``onnx_int8.quantize_graph`` (each row its
own scale: the graphs ``qvlctl model export-onnx --weights int8`` writes) and by
onnxruntime's ``quantize_dynamic`` with the options qvld's export used before (one scale
per tensor; ONNX Runtime fuses it into DynamicQuantizeMatMul); a third graph is ours
with each row scale handed to MatMulIntegerToFloat instead of a Mul after it (the
alternative ``onnx_int8`` passed over). Timing: the sessions run in turn, ``--repeats``
times per size, each turn in the other order; printed per graph: the median of its time
over the per-tensor graph's in the same turn (paired, so that the shared machine's drift
cancels), and the medians and minimums. ``--runs N``: build them, run each N times at
the first size and exit, for an instruction count that does not depend on the
machine's load (the difference of two counts over the difference of their runs is one
run's instructions; one intra-op thread, no spinning, so that the count repeats);
``--only`` runs one graph there (``tensor``, ``row``, ``row-gemm``).

Also printed: whether a row's output alone equals its output in the batch, per graph.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qvld.modeltools.onnx_int8 import quantize_graph

HIDDEN, KV, MLP = 2048, 1024, 6144


def float_graph(path: Path, layers: int, seed: int = 0) -> None:
    """``layers`` decoder layers' MatMuls (q, k, v, o, gate, up, down) with float weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    weights = [numpy_helper.from_array(np.ones(HIDDEN, np.float32), "gamma"),
               numpy_helper.from_array(np.ones(MLP, np.float32), "gamma_mlp")]
    count = iter(range(1 << 30))

    def name(prefix: str) -> str:
        return f"{prefix}{next(count)}"

    def op(kind: str, inputs: list[str], **attrs: Any) -> str:
        out = name(kind.lower())
        nodes.append(helper.make_node(kind, inputs, [out], name=out, **attrs))
        return out

    def matmul(x: str, k: int, n: int) -> str:
        w = name("w")
        weights.append(numpy_helper.from_array(
            (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), w))
        return op("MatMul", [x, w])

    x = "x"
    for _ in range(layers):
        h = op("LayerNormalization", [x, "gamma"], axis=-1)
        attention = op("Add", [matmul(h, HIDDEN, HIDDEN), op("Concat", [
            matmul(h, HIDDEN, KV), matmul(h, HIDDEN, KV)], axis=-1)])
        r = op("Add", [matmul(attention, HIDDEN, HIDDEN), x])
        h = op("LayerNormalization", [r, "gamma"], axis=-1)
        gated = op("Mul", [matmul(h, HIDDEN, MLP), matmul(h, HIDDEN, MLP)])
        h = op("LayerNormalization", [gated, "gamma_mlp"], axis=-1)
        x = op("Add", [matmul(h, MLP, HIDDEN), r])
    graph = helper.make_graph(nodes, "layers",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             ["rows", HIDDEN])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.save_model(model, str(path), save_as_external_data=True,
                    location=path.name + ".data")


def per_tensor(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, dst, weight_type=QuantType.QInt8, per_channel=True,
                     reduce_range=True, op_types_to_quantize=["MatMul"],
                     use_external_data_format=True)


def row_scale_in_the_gemm(src: Path, dst: Path) -> None:
    """Ours, each ``MatMulIntegerToFloat(.., 1, ..) * absmax`` pair as one
    MatMulIntegerToFloat taking the column of row scales."""
    import onnx

    model = onnx.load(str(src))
    nodes = list(model.graph.node)
    producer = {out: node for node in nodes for out in node.output}
    kept = []
    for node in nodes:
        source = producer.get(node.input[0]) if node.op_type == "Mul" else None
        if source is not None and source.op_type == "MatMulIntegerToFloat":
            source.input[2] = node.input[1]
            source.output[0] = node.output[0]
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    onnx.save_model(model, str(dst))


def session(path: Path, counting: bool) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = 1 if counting else len(os.sched_getaffinity(0))
    options.add_session_config_entry("session.intra_op.allow_spinning",
                                     "0" if counting else "1")
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rows", default="1,8,512")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--runs", type=int, default=0,
                        help="run each graph this many times at the first size and exit")
    parser.add_argument("--only", choices=["tensor", "row", "row-gemm"],
                        help="with --runs: only this graph")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="qmm-") as tmp:
        src = Path(tmp) / "float.onnx"
        float_graph(src, args.layers)
        graphs = {"per tensor": Path(tmp) / "tensor.onnx", "per row": Path(tmp) / "row.onnx",
                  "per row, scaled in the GEMM": Path(tmp) / "fused.onnx"}
        per_tensor(src, graphs["per tensor"])
        quantize_graph(src, graphs["per row"])
        row_scale_in_the_gemm(graphs["per row"], graphs["per row, scaled in the GEMM"])
        sessions = {label: session(path, args.runs > 0) for label, path in graphs.items()}
    rng = np.random.default_rng(1)
    if args.runs:
        x = rng.standard_normal((sizes[0], HIDDEN)).astype(np.float32)
        shown = dict(zip(["tensor", "row", "row-gemm"], sessions.values(), strict=True))
        for key, s in shown.items():
            if args.only not in (None, key):
                continue
            for _ in range(args.runs + 1):  # one warm-up
                s.run(None, {"x": x})
        return 0
    for n in sizes:
        # Rows of very different magnitudes: a per-tensor scale is the largest one's.
        x = (rng.standard_normal((n, HIDDEN)) * rng.uniform(0.01, 10, (n, 1))).astype(np.float32)
        invariant = {label: bool(np.array_equal(
            s.run(None, {"x": x})[0][-1:], s.run(None, {"x": x[-1:]})[0]))
            for label, s in sessions.items()}
        times: dict[str, list[float]] = {label: [] for label in sessions}
        for r in range(args.repeats):
            for label, s in list(sessions.items())[::-1 if r % 2 else 1]:
                t0 = time.perf_counter()
                s.run(None, {"x": x})
                times[label].append(time.perf_counter() - t0)
        base = times["per tensor"]
        print(f"{n} rows:", flush=True)
        for label, t in times.items():
            paired = statistics.median([a / b for a, b in zip(t, base, strict=True)])
            print(f"  {label}: {paired:.3f}x per tensor (paired), median "
                  f"{1000 * statistics.median(t):.2f} ms, min {1000 * min(t):.2f} ms; a row "
                  f"alone = in the batch: {'yes' if invariant[label] else 'no'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
