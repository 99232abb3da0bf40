"""What a response format costs: decode ms/token with the receipt schema against the same
request unconstrained, interleaved round by round on one engine; the schema's compile
time (first request) and what a cached schema adds (nothing); the mask per token.

    python bench/structured.py MODEL_DIR [--rounds 5] [--tokens 64] [--json FILE]
                               [--validate N]

Text prompts (no image: the image path is the same either way, and decode is what a
format can slow). The unconstrained request ignores eos so that both decode ``--tokens``
tokens; the constrained one stops only at ``--tokens`` too unless its grammar completes
first (a random-weight model's receipt runs longer than 64 tokens).

``--validate N`` then asks N questions in every format of the test suite (the receipt
schema, a date regex, a Lark and a GBNF grammar), greedy and sampled, four at a time
(batched), and checks every answer with the tests' own validators.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest
from qvld.engine.decoding.constraints import GrammarCompiler
from qvld.engine.decoding.response_format import parse_response_format

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' validators
RECEIPT = json.loads((ROOT / "tests" / "fixtures" / "formats" / "receipt.schema.json")
                     .read_text())
QUESTION = "Read this receipt and give its merchant, date, currency, items and total."


def per_token_ms(result: Any) -> float:
    n = result.usage.completion_tokens
    return 1e3 * result.timings.decode_s / max(1, n - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--validate", type=int, default=0, metavar="N",
                        help="then N answers in every test format, all checked")
    args = parser.parse_args(argv)

    receipt = parse_response_format({"type": "json_schema", "schema": RECEIPT})
    assert receipt is not None
    # The compile on its own, over this model's tokenizer: the vocabulary trie first.
    spec = json.loads((args.model / "config.json").read_text())
    vocab = int(spec.get("text_config", spec)["vocab_size"])
    t0 = time.perf_counter()
    compiler = GrammarCompiler(args.model / "tokenizer.json", vocab, [0])
    compiler.load()
    tokenizer_s = time.perf_counter() - t0
    first = compiler.start(receipt, 60)
    first.wait()
    cached = compiler.start(receipt, 60)
    cached.wait()
    compiler.close()

    t0 = time.perf_counter()
    # Forced tokens one step each: this measures what the mask costs a step (fast-forward,
    # which takes steps away, is bench/fast_forward.py's).
    engine = Engine(Config(model=ModelConfig(path=args.model),
                           engine=EngineConfig(max_new_tokens=max(512, args.tokens),
                                               grammar_fast_forward=False)))
    engine.warmup()
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {engine.runtime}")

    def ask(n: int, constrained: bool) -> Any:
        return engine.generate(GenerateRequest(
            messages=[{"role": "user", "content": f"{QUESTION} ({n})"}],
            max_tokens=args.tokens, temperature=0.0, ignore_eos=not constrained,
            response_format=receipt if constrained else None))

    engine.generate(GenerateRequest(messages=[{"role": "user", "content": "warm"}],
                                    max_tokens=4, response_format=parse_response_format(
                                        {"type": "regex", "pattern": "[a-z]+"})))
    plain: list[float] = []
    masked: list[float] = []
    masks: list[float] = []
    compiles: list[float | None] = []
    tokens: list[int] = []
    for n in range(args.rounds):
        for constrained in ((False, True) if n % 2 == 0 else (True, False)):
            result = ask(n, constrained)
            if constrained:
                masked.append(per_token_ms(result))
                masks.extend(result.mask_s)
                compiles.append(result.grammar_compile_s)
                tokens.append(result.usage.completion_tokens)
                if result.finish_reason == "stop":
                    json.loads(result.text)  # a complete answer parses
            else:
                plain.append(per_token_ms(result))
        print(f"round {n + 1}: unconstrained {plain[-1]:.1f} ms/token, receipt schema "
              f"{masked[-1]:.1f} ms/token ({tokens[-1]} tokens)")
    figures = {
        "model": str(args.model), "tokens": args.tokens, "rounds": args.rounds,
        "unconstrained_ms_per_token": statistics.median(plain),
        "schema_ms_per_token": statistics.median(masked),
        "ratio": statistics.median(masked) / statistics.median(plain),
        "mask_ms_median": 1e3 * statistics.median(masks),
        "mask_ms_p99": 1e3 * sorted(masks)[int(0.99 * (len(masks) - 1))],
        "tokenizer_load_s": tokenizer_s,
        "receipt_compile_s": first.compile_s,
        "cached_compile_s": cached.compile_s,
        "engine_compile_s_per_round": compiles,
    }
    print(f"decode: {figures['unconstrained_ms_per_token']:.1f} ms/token unconstrained, "
          f"{figures['schema_ms_per_token']:.1f} with the receipt schema "
          f"({figures['ratio']:.3f}x); mask {figures['mask_ms_median']:.3f} ms median, "
          f"{figures['mask_ms_p99']:.3f} ms p99 per token")
    print(f"tokenizer trie {tokenizer_s:.2f} s (once per model, on a compile thread); "
          f"receipt schema compiled in {1e3 * (first.compile_s or 0):.1f} ms; cached: "
          f"{cached.compile_s} (no compile); in the engine: {compiles}")
    if args.validate:
        figures["validated"] = validate(engine, args.validate)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def validate(engine: Engine, n: int) -> dict[str, Any]:
    """``n`` constrained answers, four at a time; each checked, or the run fails."""
    from tests.engine.test_constraints import SYSTEM, WIRE, check_answer

    kinds = ["receipt", "date", "expression", "pairs"]

    def one(i: int) -> tuple[str, Any]:
        kind = kinds[i % len(kinds)]
        return kind, engine.generate(GenerateRequest(
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": f"{QUESTION} ({i})"}],
            max_tokens=500, temperature=(0.0, 1.0)[(i // len(kinds)) % 2], seed=i,
            response_format=parse_response_format(WIRE[kind])))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(n)))
    stopped = 0
    for kind, result in answers:
        check_answer(kind, result.text)
        stopped += result.finish_reason == "stop"
    longest = max(r.usage.completion_tokens for _, r in answers)
    print(f"{n} constrained answers on this model, all valid ({stopped} complete, longest "
          f"{longest} tokens) in {time.perf_counter() - t0:.0f} s; e.g. {answers[0][1].text}")
    return {"answers": n, "valid": n, "complete": stopped, "longest_tokens": longest}


if __name__ == "__main__":
    raise SystemExit(main())
