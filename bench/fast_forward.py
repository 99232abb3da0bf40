"""Structured output faster than free text: one extraction answer about an image, timed
whole, with qvld's fast-forward (forced tokens fed in one step), qvld without it (the
same tokens, one step each: ``engine.grammar_fast_forward: false``) and OpenVINO GenAI's
structured output (xgrammar) on the same IR, interleaved round by round in one process.

    python bench/fast_forward.py MODEL_DIR [--rounds 3] [--max-tokens 200] [--json FILE]

GenAI runs twice: with the schema as given (``StructuredOutputConfig(json_schema=...)``:
its JSON allows whitespace between tokens, and a random-weight model fills the budget
with it, so the answer never closes) and with the same schema written as a regex of
compact JSON (``regex=``: the answer a real model would give, and the fair row).

Each round draws a new 512x512 picture (256 image tokens for every system: no cache
helps anyone) and asks all four, in a rotating order, for the same 8-field schema
(greedy). Time per answer is from the call to the last token (image decoding and
encoding, prefill, decode); "after first" is the part after the first token, where the
systems differ. Then each asks again about the same picture ("again": qvld finds the
image's embedding and the prompt's KV rows cached, so the answer is mostly decode;
GenAI has no cache across calls). Printed per system: seconds, tokens, forced tokens
(qvld), whether the answers validate.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from scenes import scene_image  # noqa: E402
from systems import ensure_tokenizer_ir, token_stamps  # noqa: E402

QUESTION = ("Extract the product in this photo as JSON: its name, brand, colour, "
            "category, price, currency, whether it is in stock and its rating.")
# Eight fields, bounded values: an extraction answer of about a hundred tokens.
SCHEMA = {"type": "object", "properties": {
    "product_name": {"type": "string", "maxLength": 24},
    "brand": {"type": "string", "maxLength": 16},
    "colour": {"type": "string", "maxLength": 12},
    "category": {"enum": ["clothing", "electronics", "furniture", "food", "toys", "other"]},
    "price": {"type": "integer", "minimum": 0, "maximum": 9999},
    "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
    "in_stock": {"type": "boolean"},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["product_name", "brand", "colour", "category", "price", "currency",
                 "in_stock", "rating"],
    "additionalProperties": False}


def compact_regex(schema: dict[str, Any]) -> str:
    """``schema`` (flat, bounded: SCHEMA's shapes only) as a regex of compact JSON."""
    parts = []
    for name, prop in schema["properties"].items():
        if "enum" in prop:
            value = "(" + "|".join(re.escape(json.dumps(v)) for v in prop["enum"]) + ")"
        elif prop["type"] == "string":
            value = '"[^"\\\\\\x00-\\x1f]{0,' + str(prop["maxLength"]) + '}"'
        elif prop["type"] == "boolean":
            value = "(true|false)"
        elif prop["minimum"] == 0:  # 0..10**k - 1
            value = f"(0|[1-9][0-9]{{0,{len(str(prop['maximum'])) - 1}}})"
        else:
            value = f"[{prop['minimum']}-{prop['maximum']}]"
        parts.append(re.escape(json.dumps(name)) + ":" + value)
    return r"\{" + ",".join(parts) + r"\}"


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import openvino as ov
    import openvino_genai as genai

    from qvld.config import Config, EngineConfig, ModelConfig
    from qvld.engine import Engine, GenerateRequest
    from qvld.engine.decoding.response_format import parse_response_format

    ensure_tokenizer_ir(args.model)
    fmt = parse_response_format({"type": "json_schema", "schema": SCHEMA})
    engines = {name: Engine(Config(model=ModelConfig(path=args.model), engine=EngineConfig(
        grammar_fast_forward=fast, kv_cache_mb=512, max_sequences=2)))
        for name, fast in (("qvld", True), ("qvld-stepwise", False))}
    for engine in engines.values():
        engine.warmup()
    pipe = genai.VLMPipeline(str(args.model), "CPU")

    def png(image: Any) -> bytes:
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()

    def ask_qvld(name: str, image: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        result = engines[name].generate(GenerateRequest(
            messages=[{"role": "user", "content": [{"type": "image", "image": png(image)},
                                                   {"type": "text", "text": QUESTION}]}],
            max_tokens=args.max_tokens, temperature=0.0, response_format=fmt))
        return {"answer_s": time.perf_counter() - t0, "ttft_s": result.timings.ttft_s,
                "tokens": result.usage.completion_tokens,
                "forced": result.usage.forced_tokens, "image_tokens": result.usage.image_tokens,
                "finish": result.finish_reason, "valid": valid(result.text),
                "text": result.text}

    def ask_genai(name: str, image: Any) -> dict[str, Any]:
        config = genai.GenerationConfig()
        config.max_new_tokens = args.max_tokens
        config.structured_output_config = (
            genai.StructuredOutputConfig(regex=compact_regex(SCHEMA)) if name == "genai-compact"
            else genai.StructuredOutputConfig(json_schema=json.dumps(SCHEMA)))
        pixels = ov.Tensor(np.ascontiguousarray(np.asarray(image.convert("RGB"))[None]))
        stamps: list[float] = []
        t0 = time.perf_counter()
        result = pipe.generate(QUESTION, images=[pixels], generation_config=config,
                               streamer=token_stamps(stamps))
        answer_s = time.perf_counter() - t0
        text = result.texts[0]
        return {"answer_s": answer_s, "ttft_s": stamps[0] - t0 if stamps else answer_s,
                "tokens": len(stamps), "forced": 0, "finish": "?", "valid": valid(text),
                "text": text}

    systems = {"qvld": ask_qvld, "qvld-stepwise": ask_qvld, "genai-compact": ask_genai,
               "genai": ask_genai}
    warm = scene_image(512, 999)
    for name, ask in systems.items():
        ask(name, warm)
    names = list(systems)
    rows: dict[str, list[dict[str, Any]]] = {
        f"{name}{again}": [] for again in ("", " again") for name in names}
    for r in range(args.rounds):
        image = scene_image(512, r)
        for name in names[r % 4:] + names[:r % 4]:  # a different one first each round
            for again in ("", " again"):
                row = systems[name](name, image)
                row["after_first_s"] = row["answer_s"] - row["ttft_s"]
                rows[name + again].append(row)
                print(name + again, r, json.dumps({k: v for k, v in row.items()
                                                   if k != "text"}), flush=True)
        print("  e.g.", rows["qvld"][-1]["text"][:160], flush=True)

    def med(name: str, key: str) -> float:
        return float(statistics.median(row[key] for row in rows[name]))

    print(f"\nan 8-field extraction schema over a 512x512 image, greedy, max_tokens "
          f"{args.max_tokens}, {args.rounds} interleaved rounds (medians)")
    print(f"{'system':14} {'answer s':>9} {'first token s':>14} {'after first s':>14} "
          f"{'tokens':>7} {'forced':>7} {'valid':>6}")
    for name in rows:
        print(f"{name:14} {med(name, 'answer_s'):9.2f} {med(name, 'ttft_s'):14.2f} "
              f"{med(name, 'after_first_s'):14.2f} {med(name, 'tokens'):7.0f} "
              f"{med(name, 'forced'):7.0f} {sum(r['valid'] for r in rows[name])}/"
              f"{len(rows[name])}")
    for again, key, what in (("", "answer_s", "time per answer"),
                             ("", "after_first_s", "after the first token"),
                             (" again", "answer_s", "time per answer, the picture again")):
        fast, step, compact, schema = (med(n + again, key) for n in names)
        print(f"{what}: fast-forward / without {fast / step:.2f}; fast-forward / GenAI "
              f"(compact regex) {fast / compact:.2f}; fast-forward / GenAI (json_schema) "
              f"{fast / schema:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
