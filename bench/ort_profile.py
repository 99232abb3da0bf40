"""Where an ONNX Runtime decode step goes: ORT's own per-node profile, by op type.

    python bench/ort_profile.py ONNX_MODEL_DIR [--prompt 215] [--steps 16]

Runs the language-model graph alone with qvld's session options: a random prompt of
``--prompt`` rows, then ``--steps`` one-row decode steps feeding each step's presents back
as the next step's pasts. Prints ms per step and the share of each op type over the decode
steps only (the prefill is left out).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from qvld.config import EngineConfig
from qvld.engine.onnxruntime import register_shared_arena, session_options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt", type=int, default=215)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)

    register_shared_arena()
    options = session_options(EngineConfig())
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    session = ort.InferenceSession(str(args.model / "onnx_language_model.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    hidden = session.get_inputs()[0].shape[2]
    deepstack = session.get_inputs()[4].shape[0]
    cache = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in pasts}
    rng = np.random.default_rng(0)
    names = [o.name for o in session.get_outputs()]

    def run(rows: int, start: int) -> None:
        feeds = {"inputs_embeds": (rng.random((1, rows, hidden)) * 0.1).astype(np.float32),
                 "attention_mask": np.ones((1, start + rows), np.int64),
                 "position_ids": np.tile(np.arange(start, start + rows), (3, 1, 1)),
                 "visual_pos_masks": np.zeros((1, rows), bool),
                 "deepstack_visual_embeds": np.zeros((deepstack, 1, hidden), np.float32),
                 **cache}
        out = session.run(None, feeds)
        cache.update({n.replace("present.", "past_key_values."): v
                      for n, v in zip(names[1:], out[1:], strict=True)})

    run(args.prompt, 0)
    t0 = time.perf_counter()
    for step in range(args.steps):
        run(1, args.prompt + step)
    print(f"decode: {(time.perf_counter() - t0) / args.steps * 1000:.1f} ms/step at "
          f"{args.prompt}-{args.prompt + args.steps} tokens of context")
    events = json.loads(Path(session.end_profiling()).read_text())
    first = next(e for e in events if e.get("name") == "model_run")
    after = first["ts"] + first["dur"]
    by_op: collections.Counter[str] = collections.Counter()
    for event in events:
        if event["ts"] > after and event.get("cat") == "Node" \
                and event["name"].endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"]
    total = sum(by_op.values())
    for op, micros in by_op.most_common(12):
        print(f"{op:30s} {micros / 1000:8.1f} ms {micros / total:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
