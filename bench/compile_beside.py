"""A new response-format schema and a fresh picture in one request: its first token
should come in about max(compile, encode + prefill), not their sum (#45), on every
runtime (the compile runs on its grammar thread while the picture is encoded and the
prompt fed; only the first constrained token waits for it).

    python bench/compile_beside.py [MODEL] [--backend openvino|onnxruntime]
                                   [--continuous-batching on|off] [--rounds 3]
                                   [--fields 1500] [--words 1500] [--size 448]

Each round, on one engine, interleaved: (P) a fresh picture and a question, no format:
its time to first token is the encode + prefill; (C) the compile of a schema never seen
before (``--fields`` string properties with patterns: a compile of ~0.5-1 s here), alone;
(T) another fresh picture and another new schema together. Printed per round and as
medians: T / max(C, P) (1.0: fully beside) and T / (C + P) (1.0: one after the other).
``--words`` of text after the picture make the prefill long enough to compare with the
compile on a small model. MODEL defaults to the tiny test model.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from qvld.config import Config, EngineConfig, ModelConfig  # noqa: E402
from qvld.engine import Engine, GenerateRequest  # noqa: E402
from qvld.engine.decoding.constraints import parse_response_format  # noqa: E402

WORDS = ["harbour", "lantern", "granite", "meadow", "copper", "willow", "signal", "orchid",
         "valley", "ember", "quartz", "tundra"]


def picture(seed: int, size: int) -> bytes:
    """A picture no cache has seen (noise, so it is not one of the image cache's)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def schema(seed: int, fields: int) -> dict[str, Any]:
    """A schema never compiled before: ``fields`` required strings with patterns."""
    def pattern(i: int) -> str:
        return f"^[A-Z]{{2}}[0-9]{{{i % 7 + 1}}}(-[a-z]{{3,8}}){{1,3}}$"

    props = {f"field_{seed}_{i}": {"type": "string", "pattern": pattern(i)}
             for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def request(seed: int, args: argparse.Namespace, fmt: dict[str, Any] | None) -> GenerateRequest:
    text = " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(args.words))
    return GenerateRequest(
        messages=[{"role": "user", "content": [
            {"type": "image", "image": picture(seed, args.size)},
            {"type": "text", "text": f"{text}. Describe the picture."}]}],
        max_tokens=1, temperature=0.0,
        response_format=None if fmt is None else parse_response_format(
            {"type": "json_schema", "schema": fmt}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, nargs="?",
                        default=ROOT / "tests" / "fixtures" / "models" / "tiny")
    parser.add_argument("--backend", default="openvino", choices=["openvino", "onnxruntime"])
    parser.add_argument("--continuous-batching", default="on", choices=["on", "off"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fields", type=int, default=1500)
    parser.add_argument("--words", type=int, default=1500)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    engine = Engine(Config(model=ModelConfig(path=args.model, backend=args.backend),
                           engine=EngineConfig(continuous_batching=args.continuous_batching == "on",
                                               grammar_compile_timeout_s=60)))
    engine.warmup()
    rows: list[dict[str, Any]] = []
    for r in range(args.rounds):
        seed = 1000 * (r + 1)
        prefill = engine.generate(request(seed, args, None)).timings.ttft_s
        t0 = time.perf_counter()
        fmt = parse_response_format({"type": "json_schema",
                                     "schema": schema(seed + 1, args.fields)})
        assert fmt is not None
        engine.grammars.start(fmt, 60).wait()
        compile_s = time.perf_counter() - t0
        both = engine.generate(request(seed + 2, args, schema(seed + 2, args.fields)))
        rows.append({"prefill_s": prefill, "compile_s": compile_s, "both_s": both.timings.ttft_s,
                     "engine_compile_s": both.grammar_compile_s,
                     "prompt_tokens": both.usage.prompt_tokens})
        row = rows[-1]
        print(f"round {r + 1}: encode+prefill {prefill:.3f} s ({row['prompt_tokens']} rows), "
              f"compile {compile_s:.3f} s alone, together {row['both_s']:.3f} s: "
              f"{row['both_s'] / max(prefill, compile_s):.2f}x the larger, "
              f"{row['both_s'] / (prefill + compile_s):.2f}x the sum", flush=True)
    beside = statistics.median(r["both_s"] / max(r["prefill_s"], r["compile_s"]) for r in rows)
    summed = statistics.median(r["both_s"] / (r["prefill_s"] + r["compile_s"]) for r in rows)
    executor = (f"{args.backend}" + (" (stateful, slots)" if args.continuous_batching == "off"
                                     and args.backend == "openvino" else ""))
    print(f"{executor}: first token {beside:.2f}x max(compile, encode+prefill), "
          f"{summed:.2f}x their sum (median of {len(rows)} rounds)")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rows, "vs_max": beside, "vs_sum": summed,
                                         "backend": executor}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
