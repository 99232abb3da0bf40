"""One benchmark run of one system, in the process that calls it (bench/peers.py runs each
in a fresh subprocess so that peak RSS is that system's own).

Every runner loads its model, warms up on another image of the same size, then answers
a fresh image with the same prompt and ``tokens`` new tokens (eos ignored), and returns
seconds and bytes: load_s, ttft_s, tpot_s (time per output token after the first),
peak_rss, prompt_tokens and what else the system can measure.
"""

from __future__ import annotations

import io
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from scenes import scene_image

PROMPT = "Describe this image."
FOLLOW_UP = "What colours dominate?"
NEW_QUESTION = "How many objects are there?"
LARGE = (1280, 960)  # a photo-sized image, sent as is: each system applies its own budget

Result = dict[str, Any]


def peak_rss(pid: int | str = "self", field: str = "VmHWM") -> int:
    """VmHWM of a process (this one by default), in bytes (``field``: another line of
    /proc/PID/status, e.g. VmRSS, what it holds now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def large_image(seed: int) -> Image.Image:
    return scene_image(LARGE[0], seed).resize(LARGE)


def user(image: bytes | None, text: str) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image", "image": image})
    return [{"role": "user", "content": content}]


# -- qvld: the engine in this process -------------------------------------------------

def run_qvld(model: Path, size: int, tokens: int, seed: int, *, backend: str = "auto",
             precision: str = "auto", **_: Any) -> Result:
    from qvld.config import Config, EngineConfig, ModelConfig
    from qvld.engine import Engine, GenerateRequest

    t0 = time.perf_counter()
    engine = Engine(Config(model=ModelConfig(path=model, backend=backend,  # type: ignore[arg-type]
                                             precision=precision),  # type: ignore[arg-type]
                           engine=EngineConfig()))
    load = time.perf_counter() - t0
    engine.warmup()

    def ask(image: bytes | None, text: str, n: int = tokens, session: str | None = None
            ) -> Any:
        return engine.generate(GenerateRequest(messages=user(image, text), max_tokens=n,
                                               temperature=0.0, ignore_eos=True,
                                               session=session))

    ask(png(scene_image(size, seed + 1000)), PROMPT)  # warm-up
    image = png(scene_image(size, seed))
    fresh = ask(image, PROMPT, session="bench")
    rss = peak_rss()  # the workload every system runs; what follows is qvld's alone
    steady = peak_rss(field="VmRSS")
    follow_up = ask(None, FOLLOW_UP, n=2, session="bench")
    seen = ask(image, NEW_QUESTION, n=2)
    large = ask(png(large_image(seed)), PROMPT, n=2)
    n = fresh.usage.completion_tokens
    return {"load_s": load, "ttft_s": fresh.timings.ttft_s,
            "tpot_s": fresh.timings.decode_s / max(n - 1, 1), "tokens": n,
            "prompt_tokens": fresh.usage.prompt_tokens,
            "ttft_follow_up_s": follow_up.timings.ttft_s, "ttft_seen_s": seen.timings.ttft_s,
            "ttft_large_s": large.timings.ttft_s, "large_prompt_tokens": large.usage.prompt_tokens,
            "weights": engine.models.runtime_properties.get("WEIGHTS"),
            "runtime": engine.models.runtime, "steady_rss": steady,
            "peak_rss": rss, "peak_rss_all": peak_rss()}


# -- qvld: the daemon, asked through qvlctl's client ------------------------------------

def _start_daemon(model: Path, workdir: Path, cache: Path, extra: tuple[str, ...] = (),
                  prefix: tuple[str, ...] = (), source: Path | None = None
                  ) -> tuple[subprocess.Popen[bytes], float]:
    """Start qvld (``extra``: more arguments, such as --set; ``prefix``: a command it
    runs under, such as taskset; ``source``: another checkout whose qvld runs, such as
    a git worktree of an earlier commit); return it and the seconds until health says
    ready."""
    from qvlctl.client import Client

    sock = workdir / "qvld.sock"
    (workdir / "qvld.yaml").write_text("")
    argv = [*prefix, sys.executable, "-m", "qvld.cli", "--config", str(workdir / "qvld.yaml"),
            "--model", str(model), "--socket", str(sock), "--set", f"model.cache_dir={cache}",
            "--set", "metrics.listen=", "--set", "tuning.apply=false", *extra]
    t0 = time.perf_counter()
    env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
    # ``python -m`` puts the working directory first on the path: run in the source's.
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, cwd=source)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"qvld exited {proc.returncode}")
        try:
            with Client(sock, timeout=5) as client:
                if client.health()["ready"]:
                    return proc, time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.02)


def run_daemon(model: Path, size: int, tokens: int, seed: int, **_: Any) -> Result:
    from qvlctl.client import Client

    workdir = Path(tempfile.mkdtemp(prefix="qvld-bench-"))
    try:
        cache = workdir / "cache"
        proc, ready_cold = _start_daemon(model, workdir, cache)
        proc.terminate()
        proc.wait(60)
        proc, ready_warm = _start_daemon(model, workdir, cache)
        try:
            sock = workdir / "qvld.sock"

            def ask(image: bytes, n: int) -> tuple[float, float, Result]:
                events = TokenEvents()
                with Client(sock, timeout=600) as client:
                    t0 = time.perf_counter()
                    reply = client.generate(
                        {"messages": user(image, PROMPT), "max_tokens": n, "temperature": 0,
                         "ignore_eos": True}, on_token=events.add)
                return events.first - t0, events.per_token(), reply

            ask(png(scene_image(size, seed + 1000)), tokens)  # warm-up
            ttft, tpot, reply = ask(png(scene_image(size, seed)), tokens)
            # qvlctl ask, as a user types it: the whole command, process start to exit.
            image_file = workdir / "scene.png"
            image_file.write_bytes(png(scene_image(size, seed + 2000)))
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "qvlctl.cli", "--socket", str(sock), "ask",
                            "--max-tokens", str(tokens), "--temperature", "0",
                            str(image_file), PROMPT],
                           check=True, capture_output=True)
            qvlctl_s = time.perf_counter() - t0
            rss = peak_rss(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
        return {"load_s": ready_warm, "ready_cold_s": ready_cold, "ready_warm_s": ready_warm,
                "ttft_s": ttft, "tpot_s": tpot, "tokens": len(reply.get("token_ids", [])),
                "prompt_tokens": reply.get("usage", {}).get("prompt_tokens"),
                "qvlctl_ask_s": qvlctl_s, "peak_rss": rss}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# -- OpenVINO GenAI ----------------------------------------------------------------------

def ensure_tokenizer_ir(model: Path) -> None:
    """GenAI needs the tokenizer as OpenVINO IR; converted once, beside the model."""
    if (model / "openvino_tokenizer.xml").exists():
        return
    from openvino import save_model
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    tokenizer, detokenizer = convert_tokenizer(AutoTokenizer.from_pretrained(model),
                                               with_detokenizer=True)
    save_model(tokenizer, model / "openvino_tokenizer.xml")
    save_model(detokenizer, model / "openvino_detokenizer.xml")


class TokenEvents:
    """A stream's token events as a client sees them: one event may carry several tokens
    (the daemon sends text when it is whole), so time per token counts the ids."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, int]] = []

    def add(self, text: str, ids: list[int]) -> None:
        self.stamps.append((time.perf_counter(), len(ids)))

    @property
    def first(self) -> float:
        return self.stamps[0][0]

    def per_token(self) -> float:
        """Seconds per token after the first event's."""
        later = sum(n for _, n in self.stamps[1:])
        return (self.stamps[-1][0] - self.stamps[0][0]) / max(later, 1)


def token_stamps(stamps: list[float]) -> Any:
    """A GenAI ``StreamerBase`` that appends the time each generated token arrives (a text
    streamer, a callable, is first called about two tokens late: it holds tokens back
    until they decode to whole text)."""
    import openvino_genai as genai

    class Stamps(genai.StreamerBase):  # type: ignore[misc,name-defined]
        def write(self, token: Any) -> Any:
            stamps.append(time.perf_counter())
            return genai.StreamingStatus.RUNNING

        def end(self) -> None:
            pass

    return Stamps()


def run_genai(model: Path, size: int, tokens: int, seed: int, **_: Any) -> Result:
    import openvino as ov
    import openvino_genai as genai

    t0 = time.perf_counter()
    pipe = genai.VLMPipeline(str(model), "CPU")
    load = time.perf_counter() - t0

    def ask(image: Image.Image, n: int) -> tuple[float, float, int, int]:
        # TTFT as a caller sees it: from the call to the first generated token.
        config = genai.GenerationConfig()
        config.max_new_tokens = n
        config.ignore_eos = True
        stamps: list[float] = []
        t0 = time.perf_counter()
        result = pipe.generate(PROMPT, images=[ov.Tensor(np.asarray(image)[None])],
                               generation_config=config, streamer=token_stamps(stamps))
        metrics = result.perf_metrics
        return (stamps[0] - t0, metrics.get_tpot().mean / 1000,
                int(metrics.get_num_generated_tokens()), int(metrics.get_num_input_tokens()))

    ask(scene_image(size, seed + 1000), tokens)  # warm-up
    ttft, tpot, n, prompt = ask(scene_image(size, seed), tokens)
    result: Result = {"load_s": load, "ttft_s": ttft, "tpot_s": tpot, "tokens": n,
              "prompt_tokens": prompt, "peak_rss": peak_rss(),
              "steady_rss": peak_rss(field="VmRSS")}
    if seed == 0:  # the large image (≈1200 tokens at GenAI's budget) once: it is slow
        result["ttft_large_s"], _, _, result["large_prompt_tokens"] = ask(large_image(seed), 2)
    return result


# -- transformers-based: optimum-intel and transformers itself ---------------------------

class _Stamps:
    """A streamer that notes when each new token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def _hf_generate(model: Any, processor: Any, image: Image.Image, tokens: int
                 ) -> tuple[float, float, int, int]:
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    stamps = _Stamps()
    t0 = time.perf_counter()
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                   streamer=stamps)
    times = stamps.times
    return (times[0] - t0, (times[-1] - times[0]) / max(len(times) - 1, 1), len(times),
            int(inputs["input_ids"].shape[1]))


def build_processor(model: Path) -> Any:
    """transformers' Qwen3VLProcessor as the reference tier builds it (no torchvision)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from reference_cases import build_processor as build

    return build(model)


def run_optimum(model: Path, size: int, tokens: int, seed: int, **_: Any) -> Result:
    from optimum.intel import OVModelForVisualCausalLM

    t0 = time.perf_counter()
    ov_model = OVModelForVisualCausalLM.from_pretrained(model)
    processor = build_processor(model)
    load = time.perf_counter() - t0
    _hf_generate(ov_model, processor, scene_image(size, seed + 1000), tokens)
    ttft, tpot, n, prompt = _hf_generate(ov_model, processor, scene_image(size, seed), tokens)
    return {"load_s": load, "ttft_s": ttft, "tpot_s": tpot, "tokens": n, "prompt_tokens": prompt,
            "peak_rss": peak_rss()}


def run_transformers(model: Path, size: int, tokens: int, seed: int, **_: Any) -> Result:
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    t0 = time.perf_counter()
    hf = Qwen3VLForConditionalGeneration.from_pretrained(model, dtype=torch.float32).eval()
    processor = build_processor(model)
    load = time.perf_counter() - t0
    with torch.inference_mode():  # no warm-up: one run is all it gets (it is slow)
        ttft, tpot, n, prompt = _hf_generate(hf, processor, scene_image(size, seed), tokens)
    return {"load_s": load, "ttft_s": ttft, "tpot_s": tpot, "tokens": n, "prompt_tokens": prompt,
            "peak_rss": peak_rss()}


# -- llama.cpp ----------------------------------------------------------------------------

_MS = r"([0-9.]+) ms"
_STAMP = r"^(\d+)\.(\d+)\.(\d+)\.(\d+) "  # --log-timestamps: minutes.seconds.ms.us


def _mtmd(cli: Path, gguf: Path, mmproj: Path, image: Path, tokens: int) -> Result:
    """One llama-mtmd-cli run, read from its own log (-v --perf), and the child's peak RSS.

    llama.cpp's "prompt eval time" runs from the first prompt batch to the last, image
    encoding included: it is the time to the first token once the prompt is tokenised."""
    argv = [str(cli), "-m", str(gguf), "--mmproj", str(mmproj), "--image", str(image),
            "-p", PROMPT, "-n", str(tokens), "--temp", "0", "--ignore-eos",
            "-t", str(len(os.sched_getaffinity(0))), "--no-warmup", "-c", "4096",
            "--perf", "-v", "--log-timestamps"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    log = out.stderr + out.stdout
    encode = sum(float(m) for m in re.findall(r"batch encoding done in " + _MS, log))
    start = re.search(_STAMP + r"I encoding mtmd batch", log, re.MULTILINE)
    prompt = re.search(r"prompt eval time =\s+" + _MS + r" /\s+(\d+) tokens", log)
    evals = re.search(r"\beval time =\s+" + _MS + r" /\s+(\d+) runs", log)
    if not (prompt and evals and start):
        raise RuntimeError(f"no timings in llama-mtmd-cli's output:\n{log[-2000:]}")
    minutes, seconds, ms, us = (int(g) for g in start.groups())
    return {"encode_s": encode / 1000,
            "load_s": minutes * 60 + seconds + ms / 1e3 + us / 1e6,
            "ttft_s": float(prompt.group(1)) / 1000, "prompt_tokens": int(prompt.group(2)),
            "tpot_s": float(evals.group(1)) / 1000 / max(int(evals.group(2)), 1),
            "tokens": int(evals.group(2)) + 1,
            "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def run_llamacpp(model: Path, size: int, tokens: int, seed: int, *, quant: str = "Q8_0",
                 llamacpp: Path | None = None, **_: Any) -> Result:
    cli = (llamacpp or model.parent / "llama.cpp") / "build/bin/llama-mtmd-cli"
    gguf, mmproj = model / f"model-{quant}.gguf", model / "mmproj-f16.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "scene.png"
        scene_image(size, seed + 1000).save(image)
        _mtmd(cli, gguf, mmproj, image, 2)  # warm-up: the page cache holds the weights
        scene_image(size, seed).save(image)
        run = _mtmd(cli, gguf, mmproj, image, tokens)
        result = {"load_s": run["load_s"], "ttft_s": run["ttft_s"], "tpot_s": run["tpot_s"],
                  "tokens": run["tokens"], "prompt_tokens": run["prompt_tokens"],
                  "image_s": run["encode_s"], "peak_rss": run["peak_rss"]}
        if seed == 0:  # the large image (≈1200 tokens at llama.cpp's budget) once: slow
            large_image(seed).save(image)
            large = _mtmd(cli, gguf, mmproj, image, 2)
            result.update(ttft_large_s=large["ttft_s"],
                          large_prompt_tokens=large["prompt_tokens"])
    return result


RUNNERS: dict[str, Callable[..., Result]] = {
    "qvld": run_qvld, "daemon": run_daemon, "genai": run_genai, "optimum": run_optimum,
    "transformers": run_transformers, "llamacpp": run_llamacpp,
}


def watchdog(seconds: float) -> None:
    """A hung system must not hang the whole benchmark."""
    timer = threading.Timer(seconds, lambda: os._exit(124))
    timer.daemon = True
    timer.start()
