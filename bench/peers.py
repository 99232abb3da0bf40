"""qvld against its peers on the same full-size model, in one run.

    python bench/peers.py MODELS [--rounds 3] [--tokens 64] [--size 448] [--rows ...]
                          [--json OUT.json]

MODELS is the directory `make bench` fills (~/.cache/qvld-bench): the transformers
checkpoint (qwen3-vl-2b-hf), OpenVINO exports (qwen3-vl-2b-int8: optimum-cli's default
recipe, asymmetric; qwen3-vl-2b-int8-sym and -int4-sym: `qvlctl model convert`'s
recipe), GGUF files (gguf/, from `make bench-llamacpp`; rows skipped when absent) and
llama.cpp's build. Each row runs in a fresh subprocess per round (so peak RSS is its
own), rows interleaved within a round; medians over the rounds. transformers fp32 runs
once (it is slow). Also measured: this machine's read bandwidth and matmul throughput,
and each OpenVINO row's decode as a share of the bandwidth roofline (bytes of
language-model weights and KV cache read per token / bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


@dataclass(frozen=True)
class Row:
    name: str
    runner: str
    model: str  # directory under MODELS
    bits: str  # what to compare it with
    options: tuple[tuple[str, str], ...] = ()
    once: bool = False


ORT = (("backend", "onnxruntime"),)
ROWS = [
    Row("qvld engine, int8 (qvld recipe)", "qvld", "qwen3-vl-2b-int8-sym", "8"),
    Row("qvld daemon + qvlctl client, int8", "daemon", "qwen3-vl-2b-int8-sym", "8"),
    Row("qvld engine, int8 (optimum-cli IR)", "qvld", "qwen3-vl-2b-int8", "8"),
    # The same IR with int8 ONNX graphs beside it (bench/first_token.py links them), at
    # the defaults (model.backend auto: all on ONNX Runtime on a CPU without VNNI or
    # AMX, else OpenVINO decoding) and with OpenVINO decoding (images and prompts on
    # ONNX Runtime: model.prompt_backend auto), the default before #50.
    Row("qvld engine, int8 IR + int8 ONNX graphs (defaults)", "qvld",
        "qwen3-vl-2b-int8-ir+onnx", "8"),
    Row("qvld engine, int8 IR + int8 ONNX graphs, OpenVINO decoding", "qvld",
        "qwen3-vl-2b-int8-ir+onnx", "8", (("backend", "openvino"),)),
    Row("GenAI VLMPipeline, int8 (optimum-cli IR)", "genai", "qwen3-vl-2b-int8", "8"),
    Row("GenAI VLMPipeline, int8 (qvld IR)", "genai", "qwen3-vl-2b-int8-sym", "8"),
    Row("optimum-intel, int8 (optimum-cli IR)", "optimum", "qwen3-vl-2b-int8", "8"),
    Row("llama.cpp Q8_0", "llamacpp", "gguf", "8", (("quant", "Q8_0"),)),
    Row("qvld engine, int4 (qvld recipe)", "qvld", "qwen3-vl-2b-int4-sym", "4"),
    Row("GenAI VLMPipeline, int4 (qvld IR)", "genai", "qwen3-vl-2b-int4-sym", "4"),
    Row("llama.cpp Q4_K_M", "llamacpp", "gguf", "4", (("quant", "Q4_K_M"),)),
    # An fp32 IR at OpenVINO's default precision (bf16 where the CPU has AMX or
    # AVX512-BF16: the weights are converted at compile time), and at f32 like ORT.
    Row("qvld engine, OpenVINO fp32", "qvld", "qwen3-vl-2b-fp32", "32"),
    Row("qvld engine, OpenVINO fp32 (f32 compute)", "qvld", "qwen3-vl-2b-fp32", "32",
        (("precision", "f32"),)),
    Row("qvld engine, ONNX Runtime fp32", "qvld", "qwen3-vl-2b-onnx-fp32", "32", ORT),
    Row("qvld engine, ONNX Runtime int8", "qvld", "qwen3-vl-2b-onnx-int8", "8", ORT),
    Row("transformers fp32", "transformers", "qwen3-vl-2b-hf", "32", once=True),
]
FIELDS = ("load_s", "ready_cold_s", "ready_warm_s", "ttft_s", "ttft_seen_s",
          "ttft_follow_up_s", "ttft_large_s", "tpot_s", "peak_rss", "steady_rss", "prompt_tokens",
          "large_prompt_tokens", "qvlctl_ask_s")


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def child(argv: list[str]) -> int:
    from systems import RUNNERS, watchdog

    runner, model, size, tokens, seed, options = argv
    watchdog(1800)
    result = RUNNERS[runner](Path(model), int(size), int(tokens), int(seed),
                             **json.loads(options))
    print(json.dumps(result))
    return 0


def available(row: Row, models: Path) -> str | None:
    """Why a row cannot run here, or None."""
    path = models / row.model
    if row.runner == "llamacpp":
        if not (models / "llama.cpp/build/bin/llama-mtmd-cli").exists():
            return "llama.cpp not built (make bench-llamacpp)"
        if not (path / f"model-{dict(row.options)['quant']}.gguf").exists():
            return "no GGUF conversion (make bench-llamacpp)"
    elif not path.is_dir():
        return f"{path} missing"
    return None


def lm_bytes_per_token(model: Path, prompt_tokens: int, tokens: int) -> float | None:
    """Weights of the language model (the embedding table lives in its own graph and is
    read one row per token) plus the mean KV cache read per step: u8 in OpenVINO (this
    CPU's default), f32 in ONNX Runtime."""
    config_file = model / "config.json"
    weights = [model / "openvino_language_model.bin"]
    kv_bytes = 1
    if not weights[0].exists():
        weights = [model / "onnx_language_model.onnx", model / "onnx_language_model.onnx.data"]
        kv_bytes = 4
    if not weights[0].exists() or not config_file.exists():
        return None
    text = json.loads(config_file.read_text())["text_config"]
    kv_per_token = 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * text["head_dim"]
    size = sum(w.stat().st_size for w in weights if w.exists())
    return size + kv_bytes * kv_per_token * (prompt_tokens + tokens / 2)


def run_rounds(rows: list[Row], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {row.name: [] for row in rows}
    total = sum(1 if row.once else args.rounds for row in rows)
    done = 0
    for r in range(args.rounds):
        for row in rows:
            if row.once and r > 0:
                continue
            done += 1
            say(f"[{done}/{total}] round {r + 1}: {row.name} ...")
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, __file__, "--child", row.runner, str(args.models / row.model),
                 str(args.size), str(args.tokens), str(r), json.dumps(dict(row.options))],
                capture_output=True, text=True, check=False)
            if out.returncode != 0:
                say(f"  failed ({out.returncode}): {out.stderr.strip()[-600:]}")
                continue
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[row.name].append(result)
            say(f"  {time.perf_counter() - t0:.0f} s: TTFT {result['ttft_s']:.2f} s, "
                f"{result['tpot_s'] * 1000:.1f} ms/token, peak RSS "
                f"{result['peak_rss'] / 1e9:.2f} GB")
    return results


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for field in FIELDS:
        values = [r[field] for r in runs if r.get(field) is not None]
        if values:
            out[field] = statistics.median(values)
    return out


def table(rows: list[Row], med: dict[str, dict[str, float]], machine: dict[str, float],
          models: Path, tokens: int) -> list[str]:
    def cell(m: dict[str, float], key: str, scale: float = 1, fmt: str = ".2f") -> str:
        return format(m[key] * scale, fmt) if key in m else "-"

    lines = ["| system | load s | TTFT s | seen image s | follow-up s | 1280×960 TTFT s "
             "(tokens) | ms/token | tokens/s | roofline | peak RSS GB | RSS after GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        m = med.get(row.name)
        if not m:
            continue
        roofline = "-"
        per_token = lm_bytes_per_token(models / row.model, int(m.get("prompt_tokens", 0)), tokens)
        if per_token and row.runner in ("qvld", "daemon", "genai", "optimum"):
            roofline = f"{per_token / machine['read_bandwidth'] / m['tpot_s']:.0%}"
        large = "-"
        if "ttft_large_s" in m:
            large = f"{m['ttft_large_s']:.2f} ({int(m.get('large_prompt_tokens', 0))})"
        load = cell(m, "load_s")
        lines.append(f"| {row.name} | {load} | {cell(m, 'ttft_s')} | {cell(m, 'ttft_seen_s')} | "
                     f"{cell(m, 'ttft_follow_up_s')} | {large} | {cell(m, 'tpot_s', 1000, '.1f')}"
                     f" | {1 / m['tpot_s']:.1f} | {roofline} | {cell(m, 'peak_rss', 1e-9)} |"
                     f" {cell(m, 'steady_rss', 1e-9)} |")
    return lines


def verdicts(med: dict[str, dict[str, float]]) -> list[str]:
    """The issue's targets as ratios (a ratio within 1.03 is a tie)."""
    def ratio(a: str, b: str, key: str) -> str:
        if a not in med or b not in med or key not in med[a] or key not in med[b]:
            return "not measured"
        value = med[a][key] / med[b][key]
        word = "tie" if abs(value - 1) <= 0.03 else "better" if value < 1 else "worse"
        return f"{value:.2f}× ({word})"

    q8, q4 = "qvld engine, int8 (qvld recipe)", "qvld engine, int4 (qvld recipe)"
    lines = [
        f"- TTFT, fresh image, qvld int8 / GenAI int8 (optimum-cli IR): "
        f"{ratio(q8, 'GenAI VLMPipeline, int8 (optimum-cli IR)', 'ttft_s')}; "
        f"on the same IR: {ratio(q8, 'GenAI VLMPipeline, int8 (qvld IR)', 'ttft_s')}",
        f"- time per token, qvld int8 / llama.cpp Q8_0: {ratio(q8, 'llama.cpp Q8_0', 'tpot_s')}; "
        f"qvld int4 / llama.cpp Q4_K_M: {ratio(q4, 'llama.cpp Q4_K_M', 'tpot_s')}",
        f"- time per token, qvld int8 / GenAI on the same IR: "
        f"{ratio(q8, 'GenAI VLMPipeline, int8 (qvld IR)', 'tpot_s')}; int4: "
        f"{ratio(q4, 'GenAI VLMPipeline, int4 (qvld IR)', 'tpot_s')}",
        f"- peak RSS, qvld int8 / GenAI int8 (same IR): "
        f"{ratio(q8, 'GenAI VLMPipeline, int8 (qvld IR)', 'peak_rss')}",
    ]
    # #50: the layout the README recommends (the IR plus int8 ONNX graphs), at the defaults.
    fast, peer = ("qvld engine, int8 IR + int8 ONNX graphs (defaults)",
                  "GenAI VLMPipeline, int8 (optimum-cli IR)")
    lines.append(f"- the recommended layout at its defaults / GenAI (optimum-cli IR): peak RSS "
                 f"{ratio(fast, peer, 'peak_rss')}, TTFT {ratio(fast, peer, 'ttft_s')}, "
                 f"time per token {ratio(fast, peer, 'tpot_s')}")
    ort8, ort32 = "qvld engine, ONNX Runtime int8", "qvld engine, ONNX Runtime fp32"
    ov32 = "qvld engine, OpenVINO fp32 (f32 compute)"
    for what, key in (("TTFT", "ttft_s"), ("time per token", "tpot_s"), ("peak RSS", "peak_rss")):
        lines.append(f"- {what}, ONNX Runtime / OpenVINO: int8 {ratio(ort8, q8, key)}; "
                     f"fp32 {ratio(ort32, ov32, key)}")
    daemon = med.get("qvld daemon + qvlctl client, int8", {})
    if "ready_cold_s" in daemon:
        lines.append(f"- daemon READY: cold model cache {daemon['ready_cold_s']:.2f} s, warm "
                     f"{daemon['ready_warm_s']:.2f} s "
                     f"({daemon['ready_warm_s'] / daemon['ready_cold_s']:.2f}×); `qvlctl ask` "
                     f"end to end {daemon.get('qvlctl_ask_s', float('nan')):.2f} s")
    return lines


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if args_list and args_list[0] == "--child":
        return child(args_list[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--rows", help="|-separated substrings of row names to run")
    parser.add_argument("--json", type=Path, help="also write every run's figures here")
    args = parser.parse_args(args_list)

    rows = [row for row in ROWS
            if not args.rows or any(part in row.name for part in args.rows.split("|"))]
    runnable = []
    for row in rows:
        reason = available(row, args.models)
        if reason:
            say(f"skipping {row.name}: {reason}")
        else:
            runnable.append(row)
    from systems import ensure_tokenizer_ir

    for row in runnable:
        if row.runner == "genai":
            ensure_tokenizer_ir(args.models / row.model)
    say("measuring this machine's read bandwidth and matmul throughput ...")
    machine = json.loads(subprocess.run([sys.executable, str(HERE / "machine.py")],
                                        capture_output=True, text=True, check=True).stdout)
    say(f"  read {machine['read_bandwidth'] / 1e9:.1f} GB/s ({machine['cores']} cores), "
        f"matmul f32 {machine['matmul_f32'] / 1e9:.0f} GFLOP/s, bf16 "
        f"{machine['matmul_bf16'] / 1e9:.0f} GFLOP/s")
    results = run_rounds(runnable, args)
    med = {name: medians(runs) for name, runs in results.items() if runs}
    lines = [f"{args.size}×{args.size} image, {args.tokens} new tokens (eos ignored), medians of "
             f"{args.rounds} interleaved rounds; machine: {machine['cores']} cores, read "
             f"{machine['read_bandwidth'] / 1e9:.1f} GB/s, matmul f32 "
             f"{machine['matmul_f32'] / 1e9:.0f} / bf16 {machine['matmul_bf16'] / 1e9:.0f} "
             f"GFLOP/s", "", *table(runnable, med, machine, args.models, args.tokens), "",
             *verdicts(med)]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "runs": results, "medians": med},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
