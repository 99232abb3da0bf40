"""Which ONNX Runtime int8 MatMul is fastest for a prompt on this CPU.

    python bench/matmul_kernels.py [--rows 215] [--k 2048] [--n 6144] [--repeats 7]

One MatMul of a prompt's rows by a weight of the full-size language model's shape
(2048 -> 6144: the MLP's gate or up projection), in ONNX Runtime with qvld's session
options, as each kernel family would run it:

- ``fp32``: MatMul, the weights as exported;
- ``dynamic int8``: what ``qvlctl model export-onnx --weights int8`` writes
  (onnxruntime's quantize_dynamic: s8 weights per output channel, 7 bits, u8 activations
  quantised per tensor on every call, MatMulInteger);
- ``MatMulNBits`` (com.microsoft) with 8- and 4-bit weights in blocks along K, at
  ``accuracy_level`` 4 (activations quantised to int8 per block: integer dot products)
  and 0 (weights dequantised to f32).

Interleaved ``--repeats`` times; prints the median time of each and its error against
the fp32 product (max |diff| / max |fp32|). The weights are random (normal, std 0.02).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from qvld.config import EngineConfig
from qvld.engine.model.onnxruntime import session_options


def graph_model(nodes: list[onnx.NodeProto], k: int, n: int,
                initializers: list[onnx.TensorProto]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def nbits(weight: np.ndarray, bits: int, block: int, accuracy: int) -> onnx.ModelProto:
    """MatMulNBits: per block of ``block`` along K, symmetric (the default zero point
    2^(bits-1)), ``bits``-wide unsigned codes packed low nibble first."""
    k, n = weight.shape
    blocks = -(-k // block)
    padded = np.zeros((blocks * block, n), np.float32)
    padded[:k] = weight
    rows = padded.T.reshape(n, blocks, block)  # [N, blocks, block]
    top = 2 ** (bits - 1) - 1
    scales = np.abs(rows).max(axis=-1) / top
    scales[scales == 0] = 1.0
    codes = np.clip(np.rint(rows / scales[..., None]), -top - 1, top).astype(np.int32)
    codes = (codes + 2 ** (bits - 1)).astype(np.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    node = helper.make_node("MatMulNBits", ["x", "w", "scales"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy)
    return graph_model([node], k, n, [numpy_helper.from_array(codes, "w"),
                                      numpy_helper.from_array(scales.astype(np.float32)
                                                              .reshape(-1), "scales")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=215)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=6144)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((args.k, args.n)) * 0.02).astype(np.float32)
    rows = rng.standard_normal((args.rows, args.k)).astype(np.float32)
    scratch = Path(tempfile.mkdtemp())
    fp32 = scratch / "fp32.onnx"
    onnx.save(graph_model([helper.make_node("MatMul", ["x", "w"], ["y"])], args.k, args.n,
                          [numpy_helper.from_array(weight, "w")]), fp32)
    quantize_dynamic(fp32, scratch / "dynamic.onnx", weight_type=QuantType.QInt8,
                     per_channel=True, reduce_range=True)
    models = {"fp32": fp32, "dynamic int8 (qvld's export)": scratch / "dynamic.onnx"}
    for bits, block, accuracy in ((8, 32, 4), (8, 128, 4), (8, 32, 0), (4, 32, 4)):
        path = scratch / f"nbits{bits}-{block}-{accuracy}.onnx"
        onnx.save(nbits(weight, bits, block, accuracy), path)
        models[f"MatMulNBits {bits}-bit, block {block}, accuracy_level {accuracy}"] = path
    options = session_options(EngineConfig())
    sessions = {name: ort.InferenceSession(str(path), options,
                                           providers=["CPUExecutionProvider"])
                for name, path in models.items()}
    exact = rows @ weight
    errors = {name: float(np.abs(s.run(None, {"x": rows})[0] - exact).max()
                          / np.abs(exact).max()) for name, s in sessions.items()}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(args.repeats):
        for name, session in sessions.items():
            t0 = time.perf_counter()
            session.run(None, {"x": rows})
            times[name].append(time.perf_counter() - t0)
    print(f"{args.rows} x {args.k} rows by {args.k} x {args.n} weights, "
          f"{options.intra_op_num_threads} threads, onnxruntime {ort.__version__}, "
          f"medians of {args.repeats}")
    print(f"{'kernel':55s} {'ms':>8s} {'vs dynamic':>10s} {'error':>8s}")
    base = statistics.median(times["dynamic int8 (qvld's export)"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:55s} {median * 1000:8.2f} {median / base:9.2f}x {errors[name]:8.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
