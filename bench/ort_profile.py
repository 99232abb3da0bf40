"""Where ONNX Runtime's time goes: its own per-node profile, by op type.

    python bench/ort_profile.py ONNX_MODEL_DIR [--part decode|prefill|vision]
        [--prompt 215] [--context 0] [--steps 16] [--patches 784]

Runs one graph alone with qvld's session options. ``decode`` (the default) and
``prefill``: the language model on ``--context`` rows, then a random prompt chunk of
``--prompt`` rows after them, then ``--steps`` one-row decode steps, each step's cache
fed to the next; the profile is of the decode steps or of the chunk (run twice in the
same place, the second profiled: the first repacks weights). The cache is bound in
place, one buffer per layer as the engine holds it.
``vision``: the vision blocks and merger on ``--patches`` patches of one image (784: a
448x448 image), run twice, the second profiled. Prints the time and the share of each
op type.
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
from qvld.engine.model.onnxruntime import register_shared_arena, session_options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompt", type=int, default=215)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--context", type=int, default=0)
    parser.add_argument("--part", choices=["decode", "prefill", "vision"], default="decode")
    parser.add_argument("--patches", type=int, default=784)
    args = parser.parse_args(argv)

    register_shared_arena()
    options = session_options(EngineConfig())
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    if args.part == "vision":
        return profile_vision(args.model, options, args.patches)
    session = ort.InferenceSession(str(args.model / "onnx_language_model.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    pasts = [name for name in inputs if name.startswith("past_key_values.")]
    hidden = inputs["inputs_embeds"].shape[2]
    # The cache as the step loop holds it: one buffer per layer, written in place by
    # GroupQueryAttention (rows [0, seqlens_k + 1) are the sequence's).
    capacity = args.context + args.prompt + args.steps
    cache = {name: ort.OrtValue.ortvalue_from_numpy(np.zeros(
        (1, inputs[name].shape[1], capacity, inputs[name].shape[3]), np.float32))
        for name in pasts}
    rng = np.random.default_rng(0)
    binding = session.io_binding()
    for name, value in cache.items():  # each buffer the past and the present
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(name.replace("past_key_values.", "present."), value)
    binding.bind_output("logits", "cpu")

    def run(rows: int, start: int) -> None:
        feeds = {"inputs_embeds": (rng.random((1, rows, hidden)) * 0.1).astype(np.float32),
                 "position_ids": np.tile(np.arange(start, start + rows), (3, 1, 1)),
                 "visual_pos_masks": np.zeros((1, rows), bool),
                 "deepstack_visual_embeds": np.zeros((3, 1, hidden), np.float32),
                 "seqlens_k": np.array([start + rows - 1], np.int32),
                 "total_sequence_length": np.array(start + rows, np.int32)}
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        session.run_with_iobinding(binding)

    if args.context:
        run(args.context, 0)  # the rows before the chunk (not profiled)
    if args.part == "prefill":
        run(args.prompt, args.context)  # weights repacked (not profiled)
        t0 = time.perf_counter()
        run(args.prompt, args.context)  # the same rows again, in the same place
        print(f"prefill: {(time.perf_counter() - t0) * 1000:.0f} ms for {args.prompt} rows "
              f"after {args.context}")
        print_ops(session, skip_runs=2 if args.context else 1, runs=1)
        return 0
    run(args.prompt, args.context)
    t0 = time.perf_counter()
    for step in range(args.steps):
        run(1, args.context + args.prompt + step)
    start = args.context + args.prompt
    print(f"decode: {(time.perf_counter() - t0) / args.steps * 1000:.1f} ms/step at "
          f"{start}-{start + args.steps} tokens of context")
    print_ops(session, skip_runs=2 if args.context else 1, runs=args.steps)
    return 0


def profile_vision(model: Path, options: ort.SessionOptions, patches: int) -> int:
    session = ort.InferenceSession(str(model / "onnx_vision_embeddings_merger_model.onnx"),
                                   options, providers=["CPUExecutionProvider"])
    hidden = session.get_inputs()[0].shape[1]
    rotary = session.get_inputs()[-1].shape[1]
    rng = np.random.default_rng(0)
    feeds = {"hidden_states": (rng.random((patches, hidden)) * 0.1).astype(np.float32),
             "attention_mask": np.zeros((1, patches, patches), np.float32),
             "rotary_pos_emb": rng.random((patches, rotary)).astype(np.float32)}
    declared = {i.name for i in session.get_inputs()}  # graphs before 2026-12 take a mask
    feeds = {name: value for name, value in feeds.items() if name in declared}
    session.run(None, feeds)
    t0 = time.perf_counter()
    session.run(None, feeds)
    print(f"vision blocks + merger: {(time.perf_counter() - t0) * 1000:.0f} ms for "
          f"{patches} patches")
    print_ops(session, skip_runs=1, runs=1)
    return 0


def print_ops(session: ort.InferenceSession, skip_runs: int, runs: int) -> None:
    """Kernel time by op type over the runs after the first ``skip_runs``."""
    events = json.loads(Path(session.end_profiling()).read_text())
    done = [e for e in events if e.get("name") == "model_run"]
    after = done[skip_runs - 1]["ts"] + done[skip_runs - 1]["dur"]
    by_op: collections.Counter[str] = collections.Counter()
    for event in events:
        if event["ts"] > after and event.get("cat") == "Node" \
                and event["name"].endswith("_kernel_time"):
            by_op[event["args"]["op_name"]] += event["dur"]
    total = sum(by_op.values())
    print(f"{'op':30s} {'ms per run':>10s} share")
    for op, micros in by_op.most_common(12):
        print(f"{op:30s} {micros / 1000 / runs:10.1f} {micros / total:6.1%}")


if __name__ == "__main__":
    raise SystemExit(main())
