"""What a long context costs ONNX Runtime's language model (no daemon, no image).

    python bench/long_context.py MODEL_DIR [--rows 2062] [--chunk 512[,2048]]
                                 [--decode-at 200,2062] [--rounds 2]

Prefills ``--rows`` rows (random embeddings, text positions) on one ONNX Runtime slot
in chunks of ``--chunk``, as the step loop feeds a clip's prompt, and prints each
chunk's seconds: a chunk's matrix products cost the same wherever it sits, so their
growth is the attention over the rows before it. Then times decode steps (median of
10 after 2) with ``--decode-at`` rows of cache loaded into the slot. The figures of
BENCHMARKS.md "Video" (the KV cache written in place) come from here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from qvld.config import EngineConfig, ModelConfig
from qvld.engine.model.model_dir import load_model_spec
from qvld.engine.model.onnxruntime import SessionModels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rows", type=int, default=2062)
    parser.add_argument("--chunk", default="512",
                        help="rows per chunk; several (512,2048) are timed in turn")
    parser.add_argument("--decode-at", default="200,2062")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    spec = load_model_spec(args.model, "onnxruntime")
    models = SessionModels(spec, ModelConfig(path=args.model, backend="onnxruntime"),
                           EngineConfig())
    slot = models.new_slot()
    rng = np.random.default_rng(0)
    embeds = (rng.standard_normal((args.rows, spec.hidden_size)) * 0.02).astype(np.float32)
    none = slot.no_deepstack()
    sizes = [int(c) for c in args.chunk.split(",")]
    for round_ in range(args.rounds):
        # Several chunk sizes: each in turn, the order reversed every other round.
        for size in sizes if round_ % 2 == 0 else sizes[::-1]:
            slot.reset()
            chunks = []
            for lo in range(0, args.rows, size):
                hi = min(args.rows, lo + size)
                t0 = time.perf_counter()
                slot.step(embeds[lo:hi], np.tile(np.arange(lo, hi), (3, 1)),
                          np.zeros(hi - lo, bool), none)
                chunks.append(time.perf_counter() - t0)
            print(f"round {round_}: prefill {args.rows} rows {sum(chunks):.2f} s; chunks of "
                  f"{size}: " + " / ".join(f"{c:.2f}" for c in chunks), flush=True)
        for past in (int(p) for p in args.decode_at.split(",") if p):
            kv = [(rng.standard_normal((1, spec.num_kv_heads, past, spec.head_dim)) * 0.1)
                  .astype(np.float32) for _ in range(2 * spec.num_layers)]
            slot.load_rows(kv)
            row = slot.embed(np.array([100]))
            times = []
            for i in range(12):
                t0 = time.perf_counter()
                slot.step(row, np.full((3, 1), past + i), np.zeros(1, bool), none)
                times.append(time.perf_counter() - t0)
            print(f"round {round_}: decode at {past} rows "
                  f"{1000 * statistics.median(times[2:]):.1f} ms/token", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
