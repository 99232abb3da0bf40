"""What reuse saves: TTFT of a fresh image, a session follow-up, and a new question
about an image seen before (engine level, default precision).

    python bench/reuse_latency.py MODEL_DIR [--rounds 3] [--size 448]
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    engine = Engine(Config(model=ModelConfig(path=args.model),
                           engine=EngineConfig(infer_requests=2)))
    engine.warmup()

    def ask(image: bytes | None, text: str, session: str | None = None) -> dict[str, float]:
        content: list[dict[str, object]] = [{"type": "text", "text": text}]
        if image is not None:
            content.insert(0, {"type": "image", "image": image})
        t0 = time.perf_counter()
        result = engine.generate(GenerateRequest(
            messages=[{"role": "user", "content": content}], max_tokens=args.new_tokens,
            temperature=0.0, ignore_eos=True, session=session))
        return {"ttft": result.timings.ttft_s, "image": result.timings.image_s,
                "cached": result.usage.cached_tokens, "prompt": result.usage.prompt_tokens,
                "wall": time.perf_counter() - t0}

    rows: dict[str, list[dict[str, float]]] = {"fresh": [], "follow_up": [], "seen_image": []}
    for r in range(args.rounds):
        image = scene(args.size, seed=100 + r)
        rows["fresh"].append(ask(image, "Describe this image.", session=f"bench-{r}"))
        rows["follow_up"].append(ask(None, "What colours dominate?", session=f"bench-{r}"))
        rows["seen_image"].append(ask(image, "How many objects are there?"))
    for name, values in rows.items():
        for v in values:
            print(f"{name:>10}: TTFT {v['ttft']:.3f} s (image {v['image']:.3f} s), "
                  f"prompt {int(v['prompt'])} tok, {int(v['cached'])} cached")
    med = {name: statistics.median(v["ttft"] for v in values) for name, values in rows.items()}
    print(f"median TTFT: fresh {med['fresh']:.3f} s, follow-up {med['follow_up']:.3f} s "
          f"({med['follow_up'] / med['fresh']:.3f}x), seen image {med['seen_image']:.3f} s "
          f"({med['seen_image'] / med['fresh']:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
