"""A new response-format schema and a fresh picture in one request: its first token
should come in about max(compile, encode + prefill), not their sum (#45), on every
runtime (the compile runs on its grammar thread while the picture is encoded and the
prompt fed; only the first constrained token waits for it).

    python bench/compile_beside.py [MODEL] [--set model.backend=onnxruntime]
                                   [--tree OLD] [--rounds 3] [--fields 1200]
                                   [--words 300] [--size 448]

A real daemon on a socket (and ``--tree``'s, interleaved round by round). Each round:
(P) a fresh picture and a question, no format: its time to first token (streamed, as the
client sees it) is the encode + prefill; (C) the compile of a schema never seen before
(``--fields`` string properties with patterns), alone in this process; (T) another fresh
picture and another new schema in one request. Printed per round and as
medians: T / max(C, P) (1.0: fully beside) and T / (C + P) (1.0: one after the other).
``--words`` of text after the picture make the prefill long enough to compare with the
compile on a small model. MODEL defaults to the tiny test model.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from systems import _start_daemon  # noqa: E402

from qvld.engine.decoding.constraints import GrammarCompiler  # noqa: E402
from qvld.engine.decoding.response_format import parse_response_format  # noqa: E402

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
        return f"^[A-Z]{{2}}[0-9]{{{i % 7 + 1}}}(-[a-z]{{3,12}}){{1,9}}$"

    props = {f"f{seed}_{i}": {"type": "string", "pattern": pattern(i)}
             for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)}


def params(seed: int, args: argparse.Namespace, fmt: dict[str, Any] | None) -> dict[str, Any]:
    text = " ".join(WORDS[(seed + i) % len(WORDS)] for i in range(args.words))
    out: dict[str, Any] = {
        "messages": [{"role": "user", "content": [
            {"type": "image", "image": picture(seed, args.size)},
            {"type": "text", "text": f"{text}. Describe the picture."}]}],
        "max_tokens": 1, "temperature": 0.0}
    if fmt is not None:
        out["response_format"] = {"type": "json_schema", "schema": fmt}
    return out


def first_token(client: Any, request: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds from sending ``request`` to its first streamed token, as the client sees
    them (a wait in the daemon's handler counts), and the result."""
    firsts: list[float] = []
    t0 = time.perf_counter()
    result = client.generate(request, on_token=lambda *_: firsts.append(time.perf_counter()))
    assert firsts, "the answer streamed no token"
    return firsts[0] - t0, result


def compile_alone(model: Path, seed: int, fields: int) -> float:
    """The schema's compile on a compiler of this process (its trie built first)."""
    spec = json.loads((model / "config.json").read_text())
    vocab = int(spec.get("text_config", spec)["vocab_size"])
    compiler = GrammarCompiler(model / "tokenizer.json", vocab, [0])
    compiler.load()
    fmt = parse_response_format({"type": "json_schema", "schema": schema(seed, fields)})
    assert fmt is not None
    t0 = time.perf_counter()
    compiler.start(fmt, 60).wait()
    seconds = time.perf_counter() - t0
    compiler.close()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, nargs="?",
                        default=ROOT / "tests" / "fixtures" / "models" / "tiny")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="qvld settings (e.g. model.backend=onnxruntime)")
    parser.add_argument("--tree", type=Path, help="also run this checkout's qvld "
                        "(a git worktree of an earlier commit), interleaved")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fields", type=int, default=1200)
    parser.add_argument("--words", type=int, default=300)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from qvlctl.client import Client

    extra = tuple(a for kv in [*args.set, "engine.grammar_compile_timeout_s=60"]
                  for a in ("--set", kv))
    systems: dict[str, Path | None] = {"qvld": None}
    if args.tree is not None:
        systems["qvld@tree"] = args.tree.resolve()
    workdir = Path(tempfile.mkdtemp(prefix="qvld-bench-"))
    daemons = {}
    try:
        for name, source in systems.items():
            work = workdir / name
            work.mkdir()
            proc, _ = _start_daemon(args.model.resolve(), work, work / "cache", extra,
                                    source=source)
            daemons[name] = (proc, work / "qvld.sock")
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
        for r in range(args.rounds):
            for n, (name, (_, sock)) in enumerate(daemons.items()):
                seed = 1000 * (r + 1) + 10 * n
                compile_s = compile_alone(args.model, seed + 1, args.fields)
                with Client(sock, timeout=600) as client:
                    prefill, _ = first_token(client, params(seed, args, None))
                    both_s, both = first_token(client, params(
                        seed + 2, args, schema(seed + 2, args.fields)))
                row = {"prefill_s": prefill, "compile_s": compile_s, "both_s": both_s,
                       "prompt_tokens": both["usage"]["prompt_tokens"]}
                rows[name].append(row)
                print(f"round {r + 1} {name}: encode+prefill {prefill:.3f} s "
                      f"({row['prompt_tokens']} rows), compile {compile_s:.3f} s alone, "
                      f"together {row['both_s']:.3f} s: "
                      f"{row['both_s'] / max(prefill, compile_s):.2f}x the larger, "
                      f"{row['both_s'] / (prefill + compile_s):.2f}x the sum", flush=True)
    finally:
        for proc, _ in daemons.values():
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    summary = {}
    for name, runs in rows.items():
        beside = statistics.median(r["both_s"] / max(r["prefill_s"], r["compile_s"])
                                   for r in runs)
        summed = statistics.median(r["both_s"] / (r["prefill_s"] + r["compile_s"])
                                   for r in runs)
        summary[name] = {"vs_max": beside, "vs_sum": summed, "rounds": runs}
        print(f"{name} ({' '.join(args.set) or 'defaults'}): first token {beside:.2f}x "
              f"max(compile, encode+prefill), {summed:.2f}x their sum "
              f"(median of {len(runs)} rounds)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
