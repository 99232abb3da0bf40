"""What one language-model step costs for 1, 2, 4, 8 sequences on this CPU (no daemon).

    python bench/batch_step.py MODEL_DIR [--sizes 1,2,4,8] [--past 224] [--repeats 5]

Times the paged language model qvld's continuous batching runs (one decode row per
sequence, each with ``--past`` rows of KV cache), ONNX Runtime's decode lane when the
directory also holds ONNX graphs (the same rows, each step one row longer than the
last, as when decoding) and, for comparison, the stateful IR
the one-generation-per-request engine runs, fed the same number of rows at once (as a
prompt chunk, on an empty cache: the matrix kernels see the same shapes). Decode
is bound by memory bandwidth only while the matrix kernels stay cheap per extra row: the
ratio of a step of N to a step of 1 is what continuous batching can gain here. Prints
the median of ``--repeats`` steps after two warm-up steps, per size, for both.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine


def stateful_rows(slot: Any, embeds: np.ndarray, positions: np.ndarray) -> None:
    slot.reset()
    slot.step(embeds, positions, np.zeros(len(embeds), bool), slot.no_deepstack())


def matmul_kernels(engine: Engine) -> dict[str, int]:
    """Primitive types of the compiled language model's FullyConnected layers, counted."""
    language = engine.models.language  # type: ignore[attr-defined]
    kinds: Counter[str] = Counter()
    for op in language.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer, primitive = info["layerType"].astype(str), info["primitiveType"].astype(str)
        if "FullyConnected" in layer:
            kinds[f"{layer}: {primitive}"] += 1
    return dict(kinds)


def lane_steps(engine: Engine, embeds: np.ndarray, n: int, past: int,
               repeats: int) -> Callable[[], object]:
    """A step of ``n`` decoding sequences on ONNX Runtime's decode lane, each call one
    row further (as decoding goes: the lane is filled from the blocks once)."""
    model = engine.batch.model
    per_seq = (past + repeats + 8) // model.block_size + 1
    block_begins = np.arange(0, n * per_seq + 1, per_seq, dtype=np.int32)
    blocks = np.arange(n * per_seq, dtype=np.int32) % model.num_blocks
    at = [past]

    def step() -> object:
        rows = at[0]
        at[0] += 1
        return model.step(embeds, np.full((3, n), rows, np.int64), np.zeros(n, bool),
                          model.no_deepstack(), np.full(n, rows, np.int32),
                          np.arange(n + 1, dtype=np.int32), block_begins, blocks)
    return step


def median_ms(step: Callable[[], object], repeats: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--past", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    results: dict[str, dict[int, float]] = {}
    runs = [("openvino", True), ("openvino", False)]
    if (args.model / "onnx_language_model.onnx").is_file():
        runs.insert(1, ("onnxruntime", True))
    for backend, batching in runs:
        engine = Engine(Config(model=ModelConfig(path=args.model, backend=backend),  # type: ignore[arg-type]
                               engine=EngineConfig(infer_requests=max(sizes),
                                                   continuous_batching=batching)))
        hidden = engine.spec.hidden_size
        name = ("ONNX Runtime decode lane" if backend == "onnxruntime" else
                "paged (continuous batching)" if batching else "stateful (rows at once)")
        results[name] = {}
        for n in sizes:
            embeds = (rng.random((n, hidden), dtype=np.float32) * 0.1)
            if backend == "onnxruntime":
                results[name][n] = median_ms(lane_steps(engine, embeds, n, args.past,
                                                        args.repeats), args.repeats)
            elif engine.batch is not None:
                model = engine.batch.model
                per_seq = args.past // model.block_size + 1
                step = partial(model.step, embeds, np.full((3, n), args.past, np.int64),
                               np.zeros(n, bool), model.no_deepstack(),
                               np.full(n, args.past, np.int32),
                               np.arange(n + 1, dtype=np.int32),
                               np.arange(0, n * per_seq + 1, per_seq, dtype=np.int32),
                               np.arange(n * per_seq, dtype=np.int32) % model.num_blocks)
                results[name][n] = median_ms(step, args.repeats)
            else:
                with engine.pool.acquire() as slot:
                    results[name][n] = median_ms(partial(
                        stateful_rows, slot, embeds, np.tile(np.arange(n), (3, 1))),
                        args.repeats)
            print(f"{name}: {n} rows {results[name][n]:.0f} ms "
                  f"({results[name][n] / results[name][sizes[0]]:.2f}x)", flush=True)
        if batching and backend == "openvino":  # how the CPU plugin ran the matrix layers
            print("language model matmuls:", matmul_kernels(engine), flush=True)
        del engine
    print()
    print("| model | " + " | ".join(f"{n} rows ms (x)" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[n]:.0f} ({row[n] / row[sizes[0]]:.2f}x)"
                                          for n in sizes) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
