"""qvld against its peers on the same model, in one run, each system in its own process.

    python bench/peers.py MODEL_DIR [--rounds 3] [--tokens 64] [--size 448]

Systems: qvld's engine (this repository) and OpenVINO GenAI's VLMPipeline on the same
OpenVINO IR (the `bench` extra; the tokenizer IR is converted on first use). Each round
runs every system once, interleaved, in a fresh subprocess: load, one warm-up
generation, then one measured generation on a new image (448x448 by default) with the
same prompt, 64 new tokens, eos ignored. Reported: load time, TTFT, time per output
token, peak RSS (VmHWM of that process); medians over the rounds, and ratios to GenAI.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from scenes import scene_image

PROMPT = "Describe this image."


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_qvld(model: Path, size: int, tokens: int, seed: int) -> dict[str, float]:
    from qvld.config import Config, EngineConfig, ModelConfig
    from qvld.engine import Engine, GenerateRequest

    t0 = time.perf_counter()
    engine = Engine(Config(model=ModelConfig(path=model), engine=EngineConfig(
        infer_requests=1, image_cache_mb=0, kv_cache_mb=0)))
    load = time.perf_counter() - t0

    def ask(image: Image.Image) -> Any:
        buf = io.BytesIO()
        image.save(buf, "PNG")
        return engine.generate(GenerateRequest(messages=[{"role": "user", "content": [
            {"type": "image", "image": buf.getvalue()}, {"type": "text", "text": PROMPT}]}],
            max_tokens=tokens, temperature=0.0, ignore_eos=True))

    ask(scene_image(size, seed + 1000))  # warm-up
    result = ask(scene_image(size, seed))
    n = result.usage.completion_tokens
    return {"load_s": load, "ttft_s": result.timings.ttft_s,
            "tpot_s": result.timings.decode_s / max(n - 1, 1), "tokens": n,
            "prompt_tokens": result.usage.prompt_tokens, "peak_rss": peak_rss()}


def ensure_tokenizer_ir(model: Path) -> None:
    if (model / "openvino_tokenizer.xml").exists():
        return
    from openvino import save_model
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    tokenizer, detokenizer = convert_tokenizer(AutoTokenizer.from_pretrained(model),
                                               with_detokenizer=True)
    save_model(tokenizer, model / "openvino_tokenizer.xml")
    save_model(detokenizer, model / "openvino_detokenizer.xml")


def run_genai(model: Path, size: int, tokens: int, seed: int) -> dict[str, float]:
    import openvino as ov
    import openvino_genai as genai

    t0 = time.perf_counter()
    pipe = genai.VLMPipeline(str(model), "CPU")
    load = time.perf_counter() - t0
    config = genai.GenerationConfig()
    config.max_new_tokens = tokens
    config.ignore_eos = True

    def ask(image: Image.Image) -> tuple[float, float, int]:
        # GenAI's own perf metrics: TTFT from the call, mean time per output token.
        result = pipe.generate(PROMPT, images=[ov.Tensor(np.asarray(image)[None])],
                               generation_config=config)
        metrics = result.perf_metrics
        return (metrics.get_ttft().mean / 1000, metrics.get_tpot().mean / 1000,
                int(metrics.get_num_generated_tokens()))

    ask(scene_image(size, seed + 1000))  # warm-up
    ttft, tpot, n = ask(scene_image(size, seed))
    return {"load_s": load, "ttft_s": ttft, "tpot_s": tpot, "tokens": n,
            "peak_rss": peak_rss()}


SYSTEMS = {"qvld": run_qvld, "genai": run_genai}


def child(argv: list[str]) -> int:
    system, model, size, tokens, seed = argv
    print(json.dumps(SYSTEMS[system](Path(model), int(size), int(tokens), int(seed))))
    return 0


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list and args_list[0] == "--child":
        return child(args_list[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--systems", default="qvld,genai")
    args = parser.parse_args(args_list)
    systems = args.systems.split(",")
    if "genai" in systems:
        ensure_tokenizer_ir(args.model)
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems:
            print(f"round {r + 1}/{args.rounds}: {system} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--child", system, str(args.model),
                                  str(args.size), str(args.tokens), str(r)],
                                 capture_output=True, text=True, check=True)
            rows[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {s: {k: statistics.median(row[k] for row in rows[s])
               for k in ("load_s", "ttft_s", "tpot_s", "peak_rss")} for s in systems}
    print(f"{args.size}x{args.size} image, {args.tokens} new tokens, medians of "
          f"{args.rounds} interleaved rounds")
    print(f"{'system':<8} {'load s':>7} {'TTFT s':>7} {'ms/token':>9} {'peak RSS GB':>12}")
    for s in systems:
        m = med[s]
        print(f"{s:<8} {m['load_s']:>7.2f} {m['ttft_s']:>7.2f} {m['tpot_s'] * 1000:>9.1f} "
              f"{m['peak_rss'] / 1e9:>12.2f}")
    if "genai" in med and "qvld" in med:
        q, g = med["qvld"], med["genai"]
        print(f"qvld / genai: TTFT {q['ttft_s'] / g['ttft_s']:.2f}x, time per token "
              f"{q['tpot_s'] / g['tpot_s']:.2f}x, peak RSS {q['peak_rss'] / g['peak_rss']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
