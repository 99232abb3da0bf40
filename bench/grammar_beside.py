"""One user's answer beside another user's response formats that are slow to follow
(#46 item 3: an ambiguous grammar whose every token re-walks a growing Earley chart).

On the engine (the bundled tiny model, f32), times user 1002's 64 greedy tokens alone,
then while user 1001 runs four sampled answers (``n`` = 4 as separate requests) under
the grammar ``start: "0" | e "0"`` / ``e: e e | e e e | /[a-z]/`` (a variant per round,
so that none is refused as already given up on), and prints the medians and their
ratio. ``--tree PATH`` measures another checkout too, in the same run.

    python bench/grammar_beside.py [--rounds 4] [--tree PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "fixtures" / "models" / "tiny"
AMBIGUOUS = 'start: "0" | e "0"\ne: e e | e e e | /[a-z]/\n'


def measure(rounds: int) -> tuple[list[float], list[float]]:
    from qvld.config import Config, EngineConfig, ModelConfig
    from qvld.engine import Engine, GenerateRequest
    from qvld.engine.decoding.response_format import parse_response_format

    engine = Engine(Config(model=ModelConfig(path=TINY, precision="f32",
                                             kv_cache_precision="f32"),
                           engine=EngineConfig(infer_requests=2)))
    engine.warmup()

    def answer_s() -> float:
        t0 = time.perf_counter()
        engine.generate(GenerateRequest(messages=[{"role": "user", "content": "Hello"}],
                                        max_tokens=64, ignore_eos=True, temperature=0.0),
                        uid=1002)
        return time.perf_counter() - t0

    for _ in range(3):
        answer_s()
    alone = [answer_s() for _ in range(rounds + 1)]
    beside = []
    for k in range(rounds):
        fmt = parse_response_format({"type": "grammar", "grammar": AMBIGUOUS.replace(
            "/[a-z]/", f'/[a-z]/ | "{k}x"')})
        attack = [engine.submit(engine.prepare(GenerateRequest(
            messages=[{"role": "user", "content": "Hi"}], max_tokens=400, temperature=1.0,
            seed=seed, response_format=fmt), uid=1001)) for seed in range(4)]
        time.sleep(0.05)  # under way
        beside.append(answer_s())
        for gen in attack:  # each ended by its matcher budget (a 400): expected
            with contextlib.suppress(Exception):
                gen.future.result(300)
    return alone, beside


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tree", type=Path, action="append", default=[],
                        help="another checkout to measure too (repeatable)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        alone, beside = measure(args.rounds)
        a, b = statistics.median(alone), statistics.median(beside)
        print(f"64 tokens alone {a:.3f} s, beside four slow-grammar answers {b:.3f} s: "
              f"{b / a:.1f}x (beside {[round(x, 3) for x in beside]})")
        return 0
    for tree in [ROOT, *args.tree]:
        out = subprocess.run([sys.executable, __file__, "--one", "--rounds", str(args.rounds)],
                             env={**os.environ, "PYTHONPATH": str(tree.resolve())},
                             capture_output=True, text=True, check=True)
        print(f"{tree}: {out.stdout.strip().splitlines()[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
