"""What one language-model step costs for 1, 2, 4, 8 sequences on this CPU (no daemon).

    python bench/batch_step.py MODEL_DIR [--sizes 1,2,4,8] [--past 224] [--repeats 5]
    python bench/batch_step.py DIR_A DIR_B ... --lane-only [--rounds 2]

Times the paged language model qvld's continuous batching runs (one decode row per
sequence, each with ``--past`` rows of KV cache), ONNX Runtime's decode lane when the
directory also holds ONNX graphs (the same rows, each step one row longer than the
last, as when decoding) and, for comparison, the stateful IR
the one-generation-per-request engine runs, fed the same number of rows at once (as a
prompt chunk, on an empty cache: the matrix kernels see the same shapes). Decode
is bound by memory bandwidth only while the matrix kernels stay cheap per extra row: the
ratio of a step of N to a step of 1 is what continuous batching can gain here. Prints
the median of ``--repeats`` steps after two warm-up steps, per size, for both.

``--lane-only`` with several directories: ONNX Runtime's decode lane alone, each
directory's graphs in turn, ``--rounds`` times (interleaved, so that the machine's drift
falls on all of them alike, each round in the other order; printed: the median of the
rounds, and of each round's ratio to the first directory), e.g. graphs whose int8
activations are quantised per row against per tensor. ``--serve`` adds, in the same
rounds, what a user sees on each: the first token of a fresh 448x448 picture, alone, and
the aggregate tokens/s of ``--clients`` requests at once, each with a fresh picture of
its own (``--tokens`` each, eos ignored).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest


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


def lane_engine(model: Path, sizes: list[int]) -> Engine:
    return Engine(Config(model=ModelConfig(path=model, backend="onnxruntime"),
                         engine=EngineConfig(infer_requests=max(sizes))))


def picture_request(seed: int, tokens: int) -> GenerateRequest:
    from scenes import scene
    return GenerateRequest(messages=[{"role": "user", "content": [
        {"type": "image", "image": scene(448, seed)},
        {"type": "text", "text": "Describe this image."}]}],
        max_tokens=tokens, temperature=0.0, ignore_eos=True)


def serve_round(engine: Engine, seed: int, clients: int, tokens: int
                ) -> tuple[float, float]:
    """(first token of a fresh picture in s, aggregate tokens/s of ``clients`` at once)."""
    fresh = engine.generate(picture_request(seed, 1))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(engine.generate, [picture_request(seed + 1 + c, tokens)
                                                  for c in range(clients)]))
    wall = time.perf_counter() - t0
    return fresh.timings.ttft_s, sum(r.usage.completion_tokens for r in results) / wall


def compare_lanes(models: list[Path], sizes: list[int], past: int, repeats: int,
                  rounds: int, clients: int = 0, tokens: int = 64) -> int:
    """The decode lane of each directory's graphs, interleaved round by round (and, with
    ``clients``, a fresh picture's first token and the clients' aggregate tokens/s)."""
    rng = np.random.default_rng(0)
    engines = [lane_engine(model, sizes) for model in models]
    hidden = engines[0].spec.hidden_size
    embeds = {n: rng.random((n, hidden), dtype=np.float32) * 0.1 for n in sizes}
    times: dict[tuple[int, int], list[float]] = {}
    if clients:
        for engine in engines:  # warm-up: the vision graphs' first run
            engine.generate(picture_request(10_000, 2))
    for r in range(rounds):
        # Each round in the other order: neither set of graphs always runs first.
        order = list(enumerate(engines))[::-1 if r % 2 else 1]
        if clients:
            for i, engine in order:
                ttft, rate = serve_round(engine, 100 * (r + 1), clients, tokens)
                times.setdefault((i, -1), []).append(ttft * 1000)
                times.setdefault((i, -2), []).append(rate)
                print(f"round {r + 1}: {models[i].name}: fresh picture first token "
                      f"{ttft * 1000:.0f} ms, {clients} clients {rate:.2f} tokens/s", flush=True)
        for n in sizes:
            for i, engine in order:
                ms = median_ms(lane_steps(engine, embeds[n], n, past + r * (repeats + 2),
                                          repeats), repeats)
                times.setdefault((i, n), []).append(ms)
                print(f"round {r + 1}: {models[i].name}: {n} rows {ms:.0f} ms", flush=True)
    columns = sizes + ([-1, -2] if clients else [])
    heads = [f"{n} rows ms" for n in sizes] + (
        ["fresh picture first token ms", f"{clients} clients tokens/s"] if clients else [])
    print()
    print("| graphs | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(columns))
    for i, model in enumerate(models):
        cells = []
        for n in columns:
            ms = statistics.median(times[(i, n)])
            cell = f"{ms:.2f}" if ms < 20 else f"{ms:.0f}"
            if i:  # the median of the rounds' ratios: each round's pair ran side by side
                ratios = [a / b for a, b in zip(times[(i, n)], times[(0, n)], strict=True)]
                cell += f" ({statistics.median(ratios):.2f}x)"
            cells.append(cell)
        print(f"| {model.name} | " + " | ".join(cells) + " |")
    print("(medians of the rounds; in brackets, the median over the rounds of each round's "
          "ratio to the first directory)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path, nargs="+")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--past", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lane-only", action="store_true",
                        help="ONNX Runtime's decode lane only, each directory in turn")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--serve", action="store_true",
                        help="with --lane-only: a fresh picture's first token and "
                             "--clients clients' aggregate tokens/s too")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.lane_only:
        return compare_lanes(args.models, sizes, args.past, args.repeats, args.rounds,
                             args.clients if args.serve else 0, args.tokens)
    if len(args.models) != 1:
        parser.error("several directories only with --lane-only")
    args.model = args.models[0]
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
