"""Where the first token's time goes: qvld (OpenVINO, batched and alone; ONNX Runtime;
the daemon through its socket) against OpenVINO GenAI, on the same fresh image.

    python bench/first_token.py BENCH_DIR [--rounds 3] [--systems a,b,...]
                                [--sizes 448,large] [--tokens 16] [--load 0,2]
                                [--json FILE]

Every system loads once, in its own process (``--worker``), warms up on another image of
the same size, then answers one fresh image per round; rounds interleave the systems, so
each ratio compares figures taken minutes apart, not hours. For each answer it prints
the wall time from the call to the first generated token and what filled it:

- qvld (in-process engine): image decode + resize + patchify, the patch embedding,
  position embeddings, the vision blocks + merger, text embedding, each language-model
  step that fed prompt rows (its row count), the KV rows copied between runtimes, then
  the first decode step (after the first token), and what is left (tokenising,
  templating, Python between the calls);
- the daemon: the same request through the socket, first token event as qvlctl's client
  sees it, and the daemon's own TTFT from its reply (the difference is the socket and the
  request's way through the scheduler);
- GenAI ``VLMPipeline``: first token as a ``StreamerBase.write`` sees it (its text
  streamer holds tokens back), its own ``get_ttft()`` and what its perf metrics split out.

``--load N`` (the batched in-process engines only) answers the fresh image while N
other generations decode: the TTFT under continuous batching (the prompt stages then
share the cores with their steps). GenAI gets the 1280×960 photo resized to qvld's
default image-token budget (its own would make 1219 tokens of it), so both see the same
prompt. The qvld systems: ``qvld`` (defaults, on a directory holding the int8 IR and the
int8 ONNX graphs: images and prompts on ONNX Runtime), ``qvld-openvino`` (the IR alone:
everything on OpenVINO), ``qvld-alone`` (no continuous batching), ``qvld-ort`` (the ONNX
Runtime backend), ``daemon`` (defaults, through the socket).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scenes import scene_image
from systems import (
    PROMPT,
    TokenEvents,
    _start_daemon,
    ensure_tokenizer_ir,
    peak_rss,
    png,
    token_stamps,
    user,
)

BOTH = "qwen3-vl-2b-int8-ir+onnx"
SYSTEMS = {  # name: (model directory under BENCH_DIR, what it is)
    "qvld": (BOTH, "qvld engine, defaults: OpenVINO decodes, int8 ONNX graphs beside the "
                   "IR encode images and prefill (model.prompt_backend auto)"),
    "qvld-openvino": ("qwen3-vl-2b-int8", "qvld engine, everything on OpenVINO (the IR alone)"),
    "qvld-alone": ("qwen3-vl-2b-int8", "qvld engine, OpenVINO, engine.continuous_batching off"),
    "qvld-ort": ("qwen3-vl-2b-onnx-int8", "qvld engine, ONNX Runtime backend"),
    "daemon": (BOTH, "qvld daemon through its socket (qvlctl's client), defaults"),
    "genai": ("qwen3-vl-2b-int8", "OpenVINO GenAI VLMPipeline, same IR"),
}
DEFAULT_SYSTEMS = "qvld,qvld-openvino,qvld-ort,genai"
BATCHED = ("qvld", "qvld-openvino")  # the in-process engines that --load applies to
LARGE = (1280, 960)


def both_formats(bench_dir: Path) -> None:
    """BOTH: the int8 IR and the int8 ONNX graphs of one checkpoint in one directory
    (links), as `qvlctl model export-onnx ... --weights int8` into the IR's would make."""
    both = bench_dir / BOTH
    if both.exists():
        return
    both.mkdir()
    for source in (bench_dir / "qwen3-vl-2b-int8", bench_dir / "qwen3-vl-2b-onnx-int8"):
        for item in source.iterdir():
            if not (both / item.name).exists():
                (both / item.name).symlink_to(item)


def image_for(size: str, seed: int) -> Any:
    from PIL import Image

    if size == "large":
        return scene_image(LARGE[0], seed).resize(LARGE, Image.Resampling.BICUBIC)
    return scene_image(int(size), seed)


# -- qvld in this process: every backend call timed ----------------------------------------

class Stages:
    """Timed calls of one request: (name, start, end) relative to the request's start."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.events: list[tuple[str, float, float]] = []
        self.first_token = 0.0
        self.second_token = 0.0
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            self.events.clear()
            self.first_token = self.second_token = 0.0
            self.t0 = time.perf_counter()

    def note(self, name: str, begin: float, end: float) -> None:
        with self.lock:
            self.events.append((name, begin - self.t0, end - self.t0))

    def token(self) -> None:
        now = time.perf_counter() - self.t0
        if not self.first_token:
            self.first_token = now
        elif not self.second_token:
            self.second_token = now

    def breakdown(self) -> dict[str, Any]:
        """Stages before the first token, in order (steps numbered), and the first decode
        step; 'other' is what no timed call covers."""
        ttft = self.first_token
        stages: list[list[Any]] = []
        covered = reach = 0.0  # the union of the calls' intervals (they overlap under load)
        for name, begin, end in sorted(self.events, key=lambda e: e[1]):
            if begin >= ttft:
                if name.startswith("step") and not any(s[0] == "first decode step"
                                                        for s in stages):
                    stages.append(["first decode step", end - begin])
                continue
            end = min(end, ttft)
            stages.append([name, end - begin])
            covered += max(0.0, end - max(begin, reach))
            reach = max(reach, end)
        stages.insert(len([s for s in stages if s[0] != "first decode step"]),
                      ["other (tokenise, template, Python)", ttft - covered])
        return {"ttft_s": ttft, "stages": stages,
                "tpot_first_s": self.second_token - self.first_token}


_nesting = threading.local()


def timed(stages: Stages, owner: Any, method: str, name: str | Callable[..., str]) -> None:
    """Wrap ``owner.method`` so that each call is noted under ``name`` (or name(*args))."""
    original = getattr(owner, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_nesting, "depth", 0):  # a call another timed call makes: counted there
            return original(*args, **kwargs)
        _nesting.depth = 1
        begin = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _nesting.depth = 0
            label = name if isinstance(name, str) else name(*args, **kwargs)
            stages.note(label, begin, time.perf_counter())

    setattr(owner, method, wrapper)


def instrument(stages: Stages) -> None:
    from qvld.engine.inputs import prompt_builder
    from qvld.engine.model import onnxruntime, openvino, slot_paged

    # The prompt builder's own names for them (imported there by name).
    timed(stages, prompt_builder, "prepare", "image decode + resize + patchify")
    timed(stages, prompt_builder, "prepare_video", "clip decode + sample + resize + patchify")
    step_name = lambda self, embeds, *a, **k: f"step ({embeds.shape[0]} rows)"  # noqa: E731
    for cls in (openvino.Slot, onnxruntime.Slot):
        timed(stages, cls, "embed", "text embedding")
        timed(stages, cls, "step", step_name)
    timed(stages, onnxruntime.Slot, "step_batch", "decode step (the lane)")
    timed(stages, onnxruntime.Slot, "load_rows", "KV rows: shared prefix to ONNX Runtime")
    timed(stages, onnxruntime.Slot, "rows_from", "KV rows: read out of ONNX Runtime")
    for paged in (openvino.PagedLanguage, slot_paged.SlotPaged):
        timed(stages, paged, "write_rows", "KV rows: into the blocks")
        timed(stages, paged, "read_rows", "KV rows: shared prefix read")
    timed(stages, onnxruntime.Slot, "reset", "ONNX Runtime slot reset")
    # The batch runner embeds the decoding sequences' new tokens (not the prompt's).
    timed(stages, openvino.PagedLanguage, "embed", "decode-token embedding")
    timed(stages, openvino.PagedLanguage, "step", step_name)
    for cls in (openvino.Slot, onnxruntime.Slot):
        timed(stages, cls, "vision_patches", "patch embedding")
        timed(stages, cls, "vision_positions", "position embeddings")
        timed(stages, cls, "vision_merge", "vision blocks + merger")


class QvldWorker:
    def __init__(self, model: Path, backend: str, batching: bool, settings: list[str]) -> None:
        from qvld.config import Config

        self.stages = Stages()
        instrument(self.stages)
        raw: dict[str, Any] = {"model": {"path": str(model), "backend": backend},
                               "engine": {"continuous_batching": batching}}
        for item in settings:  # --set section.key=value, as qvld's own flag
            key, value = item.split("=", 1)
            section, name = key.split(".", 1)
            raw.setdefault(section, {})[name] = yaml.safe_load(value)
        from qvld.engine import Engine

        t0 = time.perf_counter()
        self.engine = Engine(Config.model_validate(raw))
        self.engine.warmup()
        self.load_s = time.perf_counter() - t0
        self.properties = dict(self.engine.models.runtime_properties)

    def ask(self, image: bytes, tokens: int, load: int) -> dict[str, Any]:
        from qvld.engine import GenerateRequest

        background = Background(self.engine, load)
        try:
            self.stages.start()
            result = self.engine.generate(
                GenerateRequest(messages=user(image, PROMPT), max_tokens=tokens,
                                temperature=0.0, ignore_eos=True),
                on_token=lambda *_: self.stages.token())
        finally:
            background.stop()
        out = self.stages.breakdown()
        n = result.usage.completion_tokens
        out.update(engine_ttft_s=result.timings.ttft_s, prompt_tokens=result.usage.prompt_tokens,
                   image_tokens=result.usage.image_tokens,
                   tpot_s=result.timings.decode_s / max(n - 1, 1), load=load,
                   others_tokens=background.tokens)
        return out


class Background:
    """``n`` long generations decoding while the measured one runs (already decoding when
    it starts: each has its first token)."""

    def __init__(self, engine: Any, n: int) -> None:
        from qvld.engine import GenerateRequest

        self.stop_flag = threading.Event()
        self.started = threading.Semaphore(0)
        self.tokens = 0
        self.threads = []
        for i in range(n):
            request = GenerateRequest(messages=user(None, f"Tell a long story, number {i}."),
                                      max_tokens=512, temperature=0.0, ignore_eos=True)
            thread = threading.Thread(target=self._run, args=(engine, request), daemon=True)
            thread.start()
            self.threads.append(thread)
        for _ in range(n):
            self.started.acquire()

    def _run(self, engine: Any, request: Any) -> None:
        first = True

        def on_token(*_: Any) -> None:
            nonlocal first
            self.tokens += 1
            if first:
                first = False
                self.started.release()

        engine.generate(request, on_token=on_token, should_stop=self.stop_flag.is_set)

    def stop(self) -> None:
        self.stop_flag.set()
        for thread in self.threads:
            thread.join()


# -- the daemon ---------------------------------------------------------------------------

class DaemonWorker:
    def __init__(self, model: Path, settings: list[str]) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="qvld-first-token-"))
        extra = tuple(arg for item in settings for arg in ("--set", item))
        self.proc, self.load_s = _start_daemon(model, self.workdir, self.workdir / "cache", extra)
        self.properties: dict[str, Any] = {}

    def ask(self, image: bytes, tokens: int, load: int) -> dict[str, Any]:
        from qvlctl.client import Client

        events = TokenEvents()
        with Client(self.workdir / "qvld.sock", timeout=600) as client:
            t0 = time.perf_counter()
            reply = client.generate(
                {"messages": user(image, PROMPT), "max_tokens": tokens, "temperature": 0,
                 "ignore_eos": True}, on_token=events.add)
        ttft = events.first - t0
        inside = reply["timings"]["ttft_s"]
        return {"ttft_s": ttft, "engine_ttft_s": inside,
                "stages": [["daemon: prepare, encode, prefill (its own TTFT)", inside],
                           ["socket, frames, scheduler", ttft - inside]],
                "tpot_s": events.per_token(),
                "prompt_tokens": reply["usage"]["prompt_tokens"], "load": load}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        shutil.rmtree(self.workdir, ignore_errors=True)


# -- OpenVINO GenAI ------------------------------------------------------------------------

class GenaiWorker:
    def __init__(self, model: Path) -> None:
        import openvino_genai as genai

        ensure_tokenizer_ir(model)
        self.genai = genai
        t0 = time.perf_counter()
        self.pipe = genai.VLMPipeline(str(model), "CPU")
        self.load_s = time.perf_counter() - t0
        self.properties = {}

    def ask(self, image: Any, tokens: int, load: int) -> dict[str, Any]:
        import openvino as ov

        genai = self.genai
        stamps: list[float] = []

        config = genai.GenerationConfig()
        config.max_new_tokens = tokens
        config.ignore_eos = True
        pixels = ov.Tensor(np.ascontiguousarray(np.asarray(image.convert("RGB"))[None]))
        t0 = time.perf_counter()
        result = self.pipe.generate(PROMPT, images=[pixels], generation_config=config,
                                    streamer=token_stamps(stamps))
        ttft = stamps[0] - t0
        metrics = result.perf_metrics
        own = metrics.get_ttft().mean / 1000
        ms = lambda get: get().mean / 1000  # noqa: E731  (GenAI reports milliseconds)
        prepare = ms(metrics.get_prepare_embeddings_duration)
        vision = ms(metrics.get_vision_encoding_duration)
        text = ms(metrics.get_text_embedding_duration)
        tokenise = ms(metrics.get_tokenization_duration)
        stages = [["tokenise", tokenise], ["vision encoder (whole)", vision],
                  ["text embedding", text],
                  ["rest of prepare embeddings", prepare - vision - text],
                  ["prefill + first token (rest of get_ttft)", own - prepare - tokenise],
                  ["outside GenAI's TTFT clock", ttft - own]]
        return {"ttft_s": ttft, "engine_ttft_s": own, "stages": stages,
                "tpot_s": metrics.get_tpot().mean / 1000,
                "prompt_tokens": int(metrics.get_num_input_tokens()), "load": load}


# -- worker and driver ------------------------------------------------------------------

def worker(system: str, model: Path, settings: list[str]) -> int:
    """Load, warm up, then answer one JSON command per stdin line on stdout."""
    if system == "genai":
        runner: Any = GenaiWorker(model)
    elif system == "daemon":
        runner = DaemonWorker(model, settings)
    else:
        runner = QvldWorker(model, "onnxruntime" if system == "qvld-ort" else "openvino",
                            system != "qvld-alone", settings)
    warmed: set[str] = set()
    print(json.dumps({"load_s": runner.load_s, "properties": runner.properties,
                      "rss": peak_rss(runner.proc.pid if isinstance(runner, DaemonWorker)
                                      else "self")}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            size = cmd["size"]
            if size not in warmed:  # every shape this size hits, run once before timing
                runner.ask(encode(system, image_for(size, cmd["seed"] + 1000)), cmd["tokens"], 0)
                warmed.add(size)
            out = runner.ask(encode(system, image_for(size, cmd["seed"])), cmd["tokens"],
                             cmd.get("load", 0))
            print(json.dumps(out), flush=True)
    finally:
        if isinstance(runner, DaemonWorker):
            runner.close()
    return 0


def encode(system: str, image: Any) -> Any:
    """GenAI takes decoded pixels, resized to qvld's default image budget (GenAI's own
    allows 1219 tokens for the 1280x960 photo: both then see the same prompt); qvld takes
    the file a client sends (PNG) and resizes it itself."""
    if system != "genai":
        return png(image)
    from PIL import Image

    from qvld.config import EngineConfig
    from qvld.engine.inputs.image import smart_resize

    budget = EngineConfig().default_image_tokens * 32 * 32  # 2x2 patches of 16 px a token
    height, width = smart_resize(image.height, image.width, 32, 256 * 256, budget)
    return image.resize((width, height), Image.Resampling.BICUBIC)


class Worker:
    def __init__(self, system: str, model: Path, settings: list[str]) -> None:
        argv = [sys.executable, __file__, "--worker", system, str(model)]
        for item in settings:
            argv += ["--set", item]
        self.system = system
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=Path(__file__).parent)
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.system}: worker exited {self.proc.wait()}")
        return dict(json.loads(line))

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(120)


def paired(results: list[dict[str, Any]], system: str, peer: str, size: str) -> str:
    """The median over rounds of ``system``'s TTFT / ``peer``'s in the same round (run
    next to each other: what the machine's load does between rounds cancels out)."""
    if system == peer:
        return "-"
    ttft = {(r["system"], r["round"]): r["ttft_s"] for r in results
            if r["size"] == size and r.get("load", 0) == 0}
    ratios = [ttft[(system, rnd)] / ttft[(peer, rnd)] for (name, rnd) in ttft
              if name == system and (peer, rnd) in ttft]
    return f"{statistics.median(ratios):.2f}×" if ratios else "-"


def spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_dir", type=Path)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    systems_help = "; ".join(f"{name} ({what})" for name, (_, what) in SYSTEMS.items())
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS,
                        help=f"comma-separated, of: {systems_help}")
    parser.add_argument("--sizes", default="448,large",
                        help="image sides, and 'large' for the 1280x960 photo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per answer")
    parser.add_argument("--load", default="0",
                        help="comma-separated numbers of other generations decoding "
                             f"meanwhile ({', '.join(BATCHED)} only)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="qvld setting for the qvld systems (repeatable)")
    parser.add_argument("--set-for", action="append", default=[],
                        metavar="SYSTEM:SECTION.KEY=VALUE",
                        help="a qvld setting for one system only (qvld@spin:engine.spin_wait=on)")
    parser.add_argument("--model", action="append", default=[], metavar="SYSTEM=DIR",
                        help="run SYSTEM on DIR (under bench_dir) instead of its own; a "
                             "system named KIND@TAG (qvld-ort@before) runs KIND, so that "
                             "two exports of one kind compare in one run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--link-only", action="store_true",
                        help=f"make {BOTH} (links to the IR and the ONNX graphs) and stop")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.bench_dir, args.set)
    if args.link_only:
        both_formats(args.bench_dir)
        return 0

    systems = args.systems.split(",")
    sizes = args.sizes.split(",")
    loads = [int(n) for n in args.load.split(",")]
    workers: dict[str, Worker] = {}
    if all((args.bench_dir / name).exists()
           for name in ("qwen3-vl-2b-int8", "qwen3-vl-2b-onnx-int8")):
        both_formats(args.bench_dir)  # else the rows that need it are skipped
    models = dict(item.split("=", 1) for item in args.model)
    for system in systems:
        kind = system.split("@")[0]  # qvld-ort@before: qvld-ort on --model's directory
        model = args.bench_dir / models.get(system, SYSTEMS[kind][0])
        if not model.exists():
            print(f"{system}: {model} missing, skipped", file=sys.stderr)
            continue
        own = [item.split(":", 1)[1] for item in args.set_for
               if item.split(":", 1)[0] == system]
        workers[system] = Worker(kind, model, [*args.set, *own])
        print(f"{system}: loaded in {workers[system].ready['load_s']:.1f} s, "
              f"RSS {workers[system].ready['rss'] / 2**30:.2f} GiB "
              f"{workers[system].ready['properties']}", flush=True)
    results: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            for size in sizes:
                for load in loads:
                    for system, w in workers.items():
                        if load and system.split("@")[0] not in BATCHED:
                            continue
                        # A new image for every answer: none is in any cache.
                        seed = rnd * 100 + loads.index(load)
                        out = w.ask(size=size, seed=seed, tokens=args.tokens, load=load)
                        name = system
                        out.update(system=name, size=size, round=rnd)
                        results.append(out)
                        print(f"round {rnd} {size:>5} load {load} {name:>10}: TTFT "
                              f"{out['ttft_s']:.3f} s  ({out['prompt_tokens']} prompt tokens, "
                              f"{out['tpot_s'] * 1000:.1f} ms/token)", flush=True)
    finally:
        for w in workers.values():
            w.close()
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def report(results: list[dict[str, Any]]) -> None:
    keys = sorted({(r["size"], r.get("load", 0)) for r in results}, key=str)
    for size, load in keys:
        rows = [r for r in results if r["size"] == size and r.get("load", 0) == load]
        print(f"\n## {size} image, {load} other generations decoding\n")
        print("| system | TTFT per round s | median s | spread | vs GenAI | vs GenAI, paired "
              "| vs qvld-ort, paired | ms/token |")
        print("|---|---|---|---|---|---|---|---|")
        genai = [r["ttft_s"] for r in results if r["system"] == "genai" and r["size"] == size]
        genai_median = statistics.median(genai) if genai else None
        for system in dict.fromkeys(r["system"] for r in rows):
            ttfts = [r["ttft_s"] for r in rows if r["system"] == system]
            tpots = [r["tpot_s"] for r in rows if r["system"] == system]
            median = statistics.median(ttfts)
            vs = f"{median / genai_median:.2f}×" if genai_median else "-"
            print(f"| {system} | {' / '.join(f'{t:.2f}' for t in ttfts)} | {median:.2f} | "
                  f"{spread(ttfts) * 100:.0f} % | {vs} | {paired(results, system, 'genai', size)} "
                  f"| {paired(results, system, 'qvld-ort', size)} "
                  f"| {statistics.median(tpots) * 1000:.1f} |")
        for system in dict.fromkeys(r["system"] for r in rows):
            runs = [r for r in rows if r["system"] == system]
            print(f"\n{system} (median over rounds of each stage, s):")
            names = list(dict.fromkeys(s[0] for r in runs for s in r["stages"]))
            for name in names:
                values = [sum(s[1] for s in r["stages"] if s[0] == name) for r in runs]
                print(f"  {name:<45} {statistics.median(values):7.3f}   "
                      f"({' / '.join(f'{v:.3f}' for v in values)})")


if __name__ == "__main__":
    sys.exit(main())
