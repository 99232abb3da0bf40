"""What a decode step's attention costs ONNX Runtime with the KV cache in f32, f16 or
int8 (GroupQueryAttention's quantised cache: per-channel scales), at Qwen3-VL-2B's shapes.

    python bench/kv_cache_precision.py [--contexts 200,1024,2062] [--rows 1] [--rounds 5]
                                       [--kinds f32,f16,int8] [--threads N]

One decoder layer's attention for ``--rows`` new rows (1: a decode step; 512: a prompt
chunk) at the end of ``context`` (16 heads over 8 KV heads of 128), run
28 times, over a cache of ``context`` rows bound as both past and present (written in
place, as the language model's graph runs it). The cache holds random rows whose
channels differ in size (as real keys' do); int8 stores ``round(x / scale)`` with one
scale per KV head and channel (``[1, kv, 1, hd]``: the cache's largest |x| / 127),
which is what a calibrated export would carry. Prints, per context, each kind's median
time for the 28 layers (kinds alternated round by round), its ratio to f32, and its
output's largest difference from f32's relative to f32's largest |output|. The numbers
decide #59's "u8 or f16 cache for decode" item.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 28
F32 = TensorProto.FLOAT
CACHE_TYPES = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "int8": TensorProto.INT8}


def graph(kind: str, capacity: int, rows: int) -> onnx.ModelProto:
    """GroupQueryAttention over a [1, kv, capacity, hd] cache of ``kind``, in place."""
    cache = CACHE_TYPES[kind]
    inputs = [helper.make_tensor_value_info("q", F32, [1, rows, HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("k", F32, [1, rows, KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("v", F32, [1, rows, KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("past_k", cache, [1, KV_HEADS, capacity, HEAD_DIM]),
              helper.make_tensor_value_info("past_v", cache, [1, KV_HEADS, capacity, HEAD_DIM]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    names = [i.name for i in inputs]
    attributes: dict[str, Any] = {}
    if kind == "int8":
        scale_shape = [1, KV_HEADS, 1, HEAD_DIM]
        inputs += [helper.make_tensor_value_info("k_scale", F32, scale_shape),
                   helper.make_tensor_value_info("v_scale", F32, scale_shape)]
        # Inputs 7-11 (cos, sin, position ids, bias, sink) absent: empty names.
        names += ["", "", "", "", "", "k_scale", "v_scale"]
        attributes = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL",
                      "kv_cache_bit_width": 8}
    outputs = [helper.make_tensor_value_info("out", F32, [1, rows, HEADS * HEAD_DIM]),
               helper.make_tensor_value_info("present_k", cache,
                                             [1, KV_HEADS, capacity, HEAD_DIM]),
               helper.make_tensor_value_info("present_v", cache,
                                             [1, KV_HEADS, capacity, HEAD_DIM])]
    node = helper.make_node("GroupQueryAttention", names, [o.name for o in outputs],
                            domain="com.microsoft", num_heads=HEADS, kv_num_heads=KV_HEADS,
                            scale=HEAD_DIM ** -0.5, **attributes)
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17),
                                             helper.make_opsetid("com.microsoft", 1)])
    return model


class Layer:
    """One kind's session with its cache bound in place (past = present)."""

    def __init__(self, kind: str, cache_k: np.ndarray, cache_v: np.ndarray, context: int,
                 threads: int, new: dict[str, np.ndarray]) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            graph(kind, cache_k.shape[2], new["q"].shape[1]).SerializeToString(), options,
            providers=["CPUExecutionProvider"])
        feeds = dict(new, seqlens_k=np.array([context - 1], np.int32),
                     total=np.array(context, np.int32))
        if kind == "int8":
            scales = {}
            rows = new["k"].shape[1]
            for name, cache in (("k", cache_k), ("v", cache_v)):
                # The rows before and the new ones (quantised as the op writes them).
                fresh = new[name].reshape(1, rows, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
                top = np.maximum(np.abs(cache[:, :, :context - rows]).max(
                    axis=2, keepdims=True, initial=0), np.abs(fresh).max(axis=2, keepdims=True))
                scales[name] = np.maximum(top, 1e-6).astype(np.float32) / 127
                feeds[f"{name}_scale"] = scales[name]
            cache_k = np.clip(np.round(cache_k / scales["k"]), -127, 127).astype(np.int8)
            cache_v = np.clip(np.round(cache_v / scales["v"]), -127, 127).astype(np.int8)
        elif kind == "f16":
            cache_k, cache_v = cache_k.astype(np.float16), cache_v.astype(np.float16)
        self.binding = self.session.io_binding()
        for name, value in feeds.items():
            self.binding.bind_cpu_input(name, value)
        self.k = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(cache_k))
        self.v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(cache_v))
        self.binding.bind_ortvalue_input("past_k", self.k)
        self.binding.bind_ortvalue_input("past_v", self.v)
        self.binding.bind_output("out")
        self.binding.bind_ortvalue_output("present_k", self.k)
        self.binding.bind_ortvalue_output("present_v", self.v)

    def run(self) -> np.ndarray:
        self.session.run_with_iobinding(self.binding)
        # The output alone (copy_outputs_to_cpu would copy the whole cache too).
        return np.asarray(self.binding.get_outputs()[0].numpy())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="200,1024,2062")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", default="f32,f16,int8")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    rng = np.random.default_rng(0)
    rows = args.rows
    print(f"{rows} new rows, {LAYERS} layers of {HEADS} heads ({KV_HEADS} KV of {HEAD_DIM}), "
          f"{args.threads} threads; seconds for all layers, median of {args.rounds}")
    print(f"{'context':>8} {'kind':>5} {'ms':>8} {'/ f32':>7} {'max |diff| / max |out|':>23}")
    for context in (int(c) for c in args.contexts.split(",")):
        capacity = context + 64
        # Channels of different sizes (a few large, as in real keys), rows random.
        spread = np.exp(rng.standard_normal((1, KV_HEADS, 1, HEAD_DIM))).astype(np.float32)
        cache_k = (rng.standard_normal((1, KV_HEADS, capacity, HEAD_DIM)) * spread
                   ).astype(np.float32)
        cache_v = rng.standard_normal((1, KV_HEADS, capacity, HEAD_DIM)).astype(np.float32)
        cache_k[:, :, context - rows:] = cache_v[:, :, context - rows:] = 0
        # The new rows end at position context - 1 (written into the cache by the op).
        new = {"q": rng.standard_normal((1, rows, HEADS * HEAD_DIM)).astype(np.float32),
               "k": (rng.standard_normal((1, rows, KV_HEADS, HEAD_DIM)) * spread[0, :, 0]
                     ).reshape(1, rows, -1).astype(np.float32),
               "v": rng.standard_normal((1, rows, KV_HEADS * HEAD_DIM)).astype(np.float32)}
        layers = {kind: Layer(kind, cache_k, cache_v, context, args.threads, new)
                  for kind in kinds}
        outputs = {kind: layer.run() for kind, layer in layers.items()}
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for round_ in range(args.rounds):
            for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
                t0 = time.perf_counter()
                for _ in range(LAYERS):
                    layers[kind].run()
                times[kind].append(time.perf_counter() - t0)
        base = statistics.median(times[kinds[0]])
        top = float(np.abs(outputs[kinds[0]]).max())
        for kind in kinds:
            median = statistics.median(times[kind])
            diff = float(np.abs(outputs[kind] - outputs[kinds[0]]).max()) / top
            print(f"{context:>8} {kind:>5} {median * 1000:>8.1f} {median / base:>6.2f}x "
                  f"{diff:>23.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
