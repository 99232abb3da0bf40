"""Image, prefill and decode time and peak RSS of the engine under one precision setting.

    python bench/decode_settings.py MODEL_DIR [--precision auto|f32|bf16] [--dq auto|off|N]
                                    [--no-release] [--runs 3] [--tokens 16]

The probe behind BENCHMARKS.md's "what made the difference" rows (precision and dynamic
quantisation, dropping mapped weight pages): warm-up, then ``runs`` generations about new
448x448 scenes; prints image/prefill seconds and ms per token of each, and VmHWM/VmRSS.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scenes import scene

import qvld.engine.engine as engine_module
from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--dq", default="auto")
    parser.add_argument("--no-release", action="store_true",
                        help="keep the mapped weight pages after warm-up (the old way)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    if args.no_release:
        engine_module.release_file_pages = lambda files: 0  # type: ignore[assignment]
    dq = int(args.dq) if args.dq.isdigit() else args.dq
    engine = Engine(Config(
        model=ModelConfig(path=args.model, precision=args.precision, dynamic_quantization=dq),
        engine=EngineConfig(infer_requests=1, image_cache_mb=0, kv_cache_mb=0)))
    print(engine.models.runtime_properties)
    engine.warmup()
    for seed in range(1, args.runs + 1):
        result = engine.generate(GenerateRequest(messages=[{"role": "user", "content": [
            {"type": "image", "image": scene(448, seed)},
            {"type": "text", "text": "Describe this image."}]}],
            max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
        t = result.timings
        print(f"image {t.image_s:.2f} s, prefill {t.prefill_s:.2f} s, "
              f"{1000 * t.decode_s / (args.tokens - 1):.0f} ms/token")
    status = Path("/proc/self/status").read_text().splitlines()
    print(" ".join(line.replace("\t", "").replace(" ", "") for line in status
                   if line.startswith(("VmHWM", "VmRSS"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
