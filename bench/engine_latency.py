"""Engine latency on one image: TTFT and time per output token (no daemon).

    python bench/engine_latency.py MODEL_DIR [--runs 3] [--new-tokens 64] [--size 448]
                                   [--backend openvino|onnxruntime]

Prints per-run figures and medians. The image is a generated 448x448 scene (196 image
tokens with the real Qwen3-VL-2B geometry); generation ignores eos so every run decodes
the same number of tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from scenes import scene

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--threads", default="auto", help="engine.threads")
    parser.add_argument("--dq", default="auto", help="model.dynamic_quantization")
    parser.add_argument("--backend", default="openvino", choices=["openvino", "onnxruntime"])
    parser.add_argument("--pin", action="store_true",
                        help="apply qvld's tuning (pin one thread per physical core) first")
    args = parser.parse_args(argv)
    threads: int | str = int(args.threads) if args.threads.isdigit() else "auto"
    if args.pin:
        from qvld import tuning

        actions, cpus = tuning.apply(Config())
        print("; ".join(f"{a.action}: {a.result} ({a.detail})" for a in actions))
        threads = len(cpus) if threads == "auto" and cpus else threads

    t0 = time.perf_counter()
    dq = int(args.dq) if args.dq.isdigit() else args.dq
    engine = Engine(Config(model=ModelConfig(path=args.model, dynamic_quantization=dq,
                                             backend=args.backend),
                           engine=EngineConfig(infer_requests=1, threads=threads)))
    print(f"load+compile {time.perf_counter() - t0:.1f} s; "
          f"runtime {engine.models.runtime_properties}")
    def messages(seed: int) -> list[dict[str, object]]:
        # A new image every run: the caches must not make TTFT look better than it is.
        return [{"role": "user", "content": [{"type": "image", "image": scene(args.size, seed)},
                                             {"type": "text", "text": "Describe this image."}]}]

    t0 = time.perf_counter()
    engine.warmup()
    engine.generate(GenerateRequest(messages=messages(0), max_tokens=2, temperature=0.0))
    print(f"warm-up {time.perf_counter() - t0:.1f} s")
    rows = []
    for run in range(args.runs):
        result = engine.generate(GenerateRequest(messages=messages(run + 1),
                                                 max_tokens=args.new_tokens,
                                                 temperature=0.0, ignore_eos=True))
        t = result.timings
        per_token = t.decode_s / max(result.usage.completion_tokens - 1, 1)
        rows.append((t.image_s, t.prefill_s, t.ttft_s, per_token))
        print(f"run {run}: prompt {result.usage.prompt_tokens} tok "
              f"(image {result.usage.image_tokens}), image {t.image_s:.2f} s, "
              f"prefill {t.prefill_s:.2f} s, TTFT {t.ttft_s:.2f} s, "
              f"{per_token * 1000:.1f} ms/token over {result.usage.completion_tokens} tokens")
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    print(f"median: image {med[0]:.2f} s, prefill {med[1]:.2f} s, TTFT {med[2]:.2f} s, "
          f"{med[3] * 1000:.1f} ms/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
