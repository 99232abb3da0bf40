"""What a prompt chunk's attention costs ONNX Runtime, in the forms a prefill graph could
take (no model: one decoder layer's attention at Qwen3-VL-2B's shapes, 28 times).

    python bench/prefill_attention.py [--rows 512] [--contexts 512,1024,1536,2048]
                                      [--rounds 5] [--threads N]

- ``gqa``: ``com.microsoft::GroupQueryAttention`` over a KV cache written in place
  (the language model's op today: ``onnx_export.CachedAttention``);
- ``matmul``: the new rows written into a copy of the cache (Slice, Concat), then every
  head's scores as one batched MatMul per KV head group ([kv, group*rows, hd] x
  [kv, hd, context]), an additive causal mask, Softmax, and a second MatMul; the cache
  copy is what a graph without the in-place op pays.

Both are checked to give the same output (max abs difference printed), then timed in
alternating order, ``--rounds`` times; the median of each context's ratio is printed
with both times for all 28 layers. The numbers decide #59's prefill form.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28
GROUP = HEADS // KV_HEADS
F32 = TensorProto.FLOAT


def gqa_graph(capacity: int) -> onnx.ModelProto:
    """GroupQueryAttention over a [1, kv, capacity, hd] cache, written in place."""
    inputs = [helper.make_tensor_value_info("q", F32, [1, "S", HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("k", F32, [1, "S", KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("v", F32, [1, "S", KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("past_k", F32, [1, KV_HEADS, capacity, HEAD_DIM]),
              helper.make_tensor_value_info("past_v", F32, [1, KV_HEADS, capacity, HEAD_DIM]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info("out", F32, [1, "S", HEADS * HEAD_DIM]),
               helper.make_tensor_value_info("present_k", F32,
                                             [1, KV_HEADS, capacity, HEAD_DIM]),
               helper.make_tensor_value_info("present_v", F32,
                                             [1, KV_HEADS, capacity, HEAD_DIM])]
    node = helper.make_node("GroupQueryAttention", [i.name for i in inputs],
                            [o.name for o in outputs], domain="com.microsoft",
                            num_heads=HEADS, kv_num_heads=KV_HEADS,
                            scale=HEAD_DIM ** -0.5)
    graph = helper.make_graph([node], "gqa", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


def matmul_graph() -> onnx.ModelProto:
    """The rows written into a copy of the cache, attention as batched MatMuls.

    q [1, S, heads*hd]; k, v [1, S, kv*hd]; past_k/v [1, kv, start, hd] (the rows
    before this chunk); mask [group*S, start+S] additive (0 or -inf)."""
    nodes = []
    inputs = [helper.make_tensor_value_info("q", F32, [1, "S", HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("k", F32, [1, "S", KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("v", F32, [1, "S", KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("past_k", F32, [1, KV_HEADS, "P", HEAD_DIM]),
              helper.make_tensor_value_info("past_v", F32, [1, KV_HEADS, "P", HEAD_DIM]),
              helper.make_tensor_value_info("mask", F32, ["GS", "T"])]
    consts = {"rows_shape": [1, -1, KV_HEADS, HEAD_DIM],
              "q_shape": [1, -1, KV_HEADS, GROUP, HEAD_DIM],
              "q_group": [KV_HEADS, -1, HEAD_DIM],
              "out_shape": [KV_HEADS, GROUP, -1, HEAD_DIM],
              "flat": [1, -1, HEADS * HEAD_DIM]}
    initializers = [helper.make_tensor(name, TensorProto.INT64, [len(v)], v)
                    for name, v in consts.items()]
    initializers.append(helper.make_tensor("scale", F32, [], [HEAD_DIM ** -0.5]))
    for name in ("k", "v"):  # [1,S,kv*hd] -> [1,kv,S,hd], after the past: the present
        nodes += [helper.make_node("Reshape", [name, "rows_shape"], [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}_new"],
                                   perm=[0, 2, 1, 3]),
                  helper.make_node("Concat", [f"past_{name}", f"{name}_new"],
                                   [f"present_{name}"], axis=2),
                  helper.make_node("Squeeze", [f"present_{name}", "zero"],
                                   [f"{name}_all"])]
    initializers.append(helper.make_tensor("zero", TensorProto.INT64, [1], [0]))
    # q: [1,S,kv,group,hd] -> [kv,group,S,hd] -> [kv, group*S, hd]
    nodes += [helper.make_node("Reshape", ["q", "q_shape"], ["q5"]),
              helper.make_node("Transpose", ["q5"], ["q_t"], perm=[2, 3, 0, 1, 4]),
              helper.make_node("Reshape", ["q_t", "q_group"], ["q_g"]),
              helper.make_node("Transpose", ["k_all"], ["k_t"], perm=[0, 2, 1]),
              helper.make_node("MatMul", ["q_g", "k_t"], ["scores"]),
              helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
              helper.make_node("Add", ["scaled", "mask"], ["masked"]),
              helper.make_node("Softmax", ["masked"], ["weights"], axis=-1),
              helper.make_node("MatMul", ["weights", "v_all"], ["o_g"]),
              helper.make_node("Reshape", ["o_g", "out_shape"], ["o4"]),
              helper.make_node("Transpose", ["o4"], ["o_t"], perm=[2, 0, 1, 3]),
              helper.make_node("Reshape", ["o_t", "flat"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", F32, [1, "S", HEADS * HEAD_DIM]),
               helper.make_tensor_value_info("present_k", F32, [1, KV_HEADS, "T", HEAD_DIM]),
               helper.make_tensor_value_info("present_v", F32, [1, KV_HEADS, "T", HEAD_DIM])]
    graph = helper.make_graph(nodes, "matmul", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def causal_mask(rows: int, start: int) -> np.ndarray:
    """[group*rows, start+rows]: row i of each head group sees columns <= start+i."""
    seen = np.arange(start + rows)[None, :] <= (start + np.arange(rows))[:, None]
    mask = np.where(seen, 0.0, -np.inf).astype(np.float32)
    return np.tile(mask, (GROUP, 1))


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def measure(gqa: ort.InferenceSession, matmul: ort.InferenceSession, rows: int,
            context: int, capacity: int, rounds: int, rng: np.random.Generator
            ) -> tuple[float, float, float, float]:
    """(GQA s, MatMul s, median ratio, max |difference|) of a chunk of ``rows`` ending
    at ``context``, for all the layers."""
    start = context - rows
    q = rng.standard_normal((1, rows, HEADS * HEAD_DIM), dtype=np.float32)
    k = rng.standard_normal((1, rows, KV_HEADS * HEAD_DIM), dtype=np.float32)
    v = rng.standard_normal((1, rows, KV_HEADS * HEAD_DIM), dtype=np.float32)
    cache_k = np.zeros((1, KV_HEADS, capacity, HEAD_DIM), np.float32)
    cache_v = np.zeros_like(cache_k)
    cache_k[:, :, :start] = rng.standard_normal((1, KV_HEADS, start, HEAD_DIM))
    cache_v[:, :, :start] = rng.standard_normal((1, KV_HEADS, start, HEAD_DIM))
    binding = gqa.io_binding()  # the cache bound as past and present: written in place
    ort_k = ort.OrtValue.ortvalue_from_numpy(cache_k)
    ort_v = ort.OrtValue.ortvalue_from_numpy(cache_v)
    for name, value in (("q", q), ("k", k), ("v", v),
                        ("seqlens_k", np.array([context - 1], np.int32)),
                        ("total", np.array(context, np.int32))):
        binding.bind_cpu_input(name, value)
    binding.bind_ortvalue_input("past_k", ort_k)
    binding.bind_ortvalue_input("past_v", ort_v)
    binding.bind_output("out")  # first: get_outputs()[0]
    binding.bind_ortvalue_output("present_k", ort_k)
    binding.bind_ortvalue_output("present_v", ort_v)
    feeds = {"q": q, "k": k, "v": v, "past_k": cache_k[:, :, :start].copy(),
             "past_v": cache_v[:, :, :start].copy(), "mask": causal_mask(rows, start)}

    def run_gqa() -> np.ndarray:
        gqa.run_with_iobinding(binding)
        # The output alone (copy_outputs_to_cpu would copy the whole cache too).
        return np.asarray(binding.get_outputs()[0].numpy())

    def run_matmul() -> np.ndarray:
        return np.asarray(matmul.run(["out"], feeds)[0])

    diff = float(np.abs(run_gqa() - run_matmul()).max())
    times: dict[str, list[float]] = {"gqa": [], "matmul": []}
    order = [("gqa", run_gqa), ("matmul", run_matmul)]
    for round_ in range(rounds):
        for name, run in order if round_ % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            for _ in range(LAYERS):
                run()
            times[name].append(time.perf_counter() - t0)
    ratios = [m / g for m, g in zip(times["matmul"], times["gqa"], strict=True)]
    return (statistics.median(times["gqa"]), statistics.median(times["matmul"]),
            statistics.median(ratios), diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--contexts", default="512,1024,1536,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    rows = args.rows
    contexts = [int(c) for c in args.contexts.split(",")]
    capacity = max(contexts)
    gqa = session(gqa_graph(capacity), args.threads)
    matmul = session(matmul_graph(), args.threads)
    rng = np.random.default_rng(0)
    print(f"{rows} rows a chunk, {LAYERS} layers of {HEADS} heads ({KV_HEADS} KV), "
          f"{args.threads} threads; seconds for all layers, median of {args.rounds}")
    print(f"{'context':>8} {'gqa s':>8} {'matmul s':>9} {'matmul/gqa':>11} {'max |diff|':>11}")
    for context in contexts:
        gqa_s, matmul_s, ratio, diff = measure(gqa, matmul, rows, context, capacity,
                                               args.rounds, rng)
        print(f"{context:>8} {gqa_s:>8.3f} {matmul_s:>9.3f} {ratio:>10.2f}x {diff:>11.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
