"""Concurrent clients: qvld (continuous batching, and one generation per infer request as
before) against llama-server (continuous batching, --parallel N+1), on the same full-size
checkpoint, in one run.

    python bench/concurrency.py MODELS [--clients 1,2,4,8] [--tokens 256] [--size 448]
                                [--systems qvld,qvld-alone,qvld-openvino,llama-server]
                                [--model DIR] [--json OUT]
                                [--before TREE]  # adds the system qvld@before

``qvld-openvino`` is qvld with ``model.backend: openvino`` (OpenVINO decoding, whatever
``auto`` chooses for the directory); ``--model`` names qvld's directory under MODELS.

``--before TREE`` runs TREE's qvld (a git worktree of an earlier commit, e.g. `git
worktree add /tmp/before d5069b8`) as the system ``qvld@before``, interleaved with the
others: the same figures for the engine before a change.

MODELS is the directory `make bench` fills (~/.cache/qvld-bench): qwen3-vl-2b-int8 (the
optimum-cli export) for qvld, gguf/model-Q8_0.gguf + mmproj-f16.gguf and llama.cpp's
build (`make bench-llamacpp`) for llama-server. Both servers get room for N+1
generations (engine.infer_requests, --parallel), so that the late arrival below is not
left waiting for a slot. For each client count the systems run
one after another (interleaved, so a noisy machine hits them alike). Every client sends
its own image and question at once, streamed, eos ignored, and records when each token
arrives. Reported per system and N:

- aggregate tokens/s: all tokens / (last answer's end - first request's start);
- TTFT median and p95;
- per-stream ms/token *while all N streams decode*: the median gap between a stream's
  tokens inside the window from the last stream's first token to the first stream's
  last token (prefill of late arrivals does not count as decode time), median over
  streams;
- at N = 4 also: 4 clients asking about one shared image (image and prefix caches), and
  the TTFT of a fifth request that arrives while 4 others decode;
- at N = 1 the median of two runs.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scenes import scene  # noqa: E402
from systems import _start_daemon  # noqa: E402

QUESTIONS = ["Describe this image.", "What colours dominate?", "How many objects are there?",
             "What is in the corner?", "Is there any text?", "What shapes do you see?",
             "Where is the brightest part?", "What would you title it?"]


@dataclass
class Stream:
    """One client's answer: when it was asked, and (arrival time, tokens) per event."""

    start: float
    events: list[tuple[float, int]] = field(default_factory=list)
    end: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)

    @property
    def first(self) -> float:
        return self.events[0][0]

    @property
    def last(self) -> float:
        return self.events[-1][0]

    def gaps(self, lo: float, hi: float) -> list[float]:
        """Per-token gaps of events inside [lo, hi] (an event of k tokens: k gaps)."""
        out: list[float] = []
        for (t0, _), (t1, n) in zip(self.events, self.events[1:], strict=False):
            if t0 >= lo and t1 <= hi:
                out += [(t1 - t0) / n] * n
        return out


# ask(image, question, tokens, first): ``first`` (optional) is set at the first token.
Ask = Callable[[bytes, str, int, "threading.Event | None"], Stream]


def summarise(streams: list[Stream]) -> dict[str, float]:
    start = min(s.start for s in streams)
    end = max(s.end for s in streams)
    ttfts = sorted(s.first - s.start for s in streams)
    lo, hi = max(s.first for s in streams), min(s.last for s in streams)
    gaps = [statistics.median(g) for s in streams if (g := s.gaps(lo, hi))]
    return {"aggregate_tok_s": sum(s.tokens for s in streams) / (end - start),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_p95_s": ttfts[min(len(ttfts) - 1, round(0.95 * (len(ttfts) - 1)))],
            "ms_per_token_all_decoding": 1000 * statistics.median(gaps) if gaps else float("nan"),
            "window_s": max(0.0, hi - lo)}


def together(ask: Ask, images: list[bytes], tokens: int) -> list[Stream]:
    """Every client at once (a barrier releases them together)."""
    barrier = threading.Barrier(len(images))
    out: list[Stream | None] = [None] * len(images)

    def client(i: int) -> None:
        barrier.wait()
        out[i] = ask(images[i], QUESTIONS[i % len(QUESTIONS)], tokens, None)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(images))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [s for s in out if s is not None]


def late_arrival(ask: Ask, images: list[bytes], late: bytes, tokens: int) -> float:
    """TTFT of one more request sent once every one of ``images``' streams decodes."""
    decoding = [threading.Event() for _ in images]
    threads = [threading.Thread(target=ask, args=(image, QUESTIONS[i], tokens, decoding[i]))
               for i, image in enumerate(images)]
    for t in threads:
        t.start()
    for event in decoding:
        event.wait(1200)
    extra = ask(late, QUESTIONS[-1], 8, None)
    for t in threads:
        t.join()
    return extra.first - extra.start


# -- qvld --------------------------------------------------------------------------------

@contextmanager
def qvld(model: Path, batching: bool, clients: int, cache: Path,
         source: Path | None = None, settings: tuple[str, ...] = ()) -> Iterator[Ask]:
    from qvlctl.client import Client

    workdir = Path(tempfile.mkdtemp(prefix="qvld-conc-"))
    sock = workdir / "qvld.sock"
    extra = ["--set", f"engine.infer_requests={clients + 1}",  # room for a late arrival
             "--set", f"engine.continuous_batching={'true' if batching else 'false'}",
             "--set", "server.queue_max=64", *settings]
    if source is None:  # running generations: its own key since the step scheduler
        extra += ["--set", f"engine.max_sequences={max(8, clients + 1)}"]
    proc, _ = _start_daemon(model, workdir, cache, tuple(extra), source=source)
    try:
        def ask(image: bytes, question: str, tokens: int,
                first: threading.Event | None = None) -> Stream:
            with Client(sock, timeout=1200) as client:
                stream = Stream(start=time.perf_counter())

                def on_token(text: str, ids: list[int]) -> None:
                    if ids:
                        stream.events.append((time.perf_counter(), len(ids)))
                        if first is not None:
                            first.set()

                client.generate({"messages": [{"role": "user", "content": [
                    {"type": "image", "image": image}, {"type": "text", "text": question}]}],
                    "max_tokens": tokens, "temperature": 0, "ignore_eos": True},
                    on_token=on_token)
                stream.end = time.perf_counter()
                return stream

        yield ask
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)


# -- llama-server ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(models: Path, clients: int) -> Iterator[Ask]:
    server = models / "llama.cpp" / "build" / "bin" / "llama-server"
    gguf = models / "gguf"
    port = free_port()
    # One slot more than the clients (idle slots cost no compute): room for a late
    # arrival. Each gets its share of -c: a 448x448 image, the question and the tokens.
    argv = [str(server), "-m", str(gguf / "model-Q8_0.gguf"), "--mmproj",
            str(gguf / "mmproj-f16.gguf"), "--parallel", str(clients + 1), "-c",
            str(2048 * (clients + 1)), "-t", str(len(os.sched_getaffinity(0))), "--port",
            str(port), "--host", "127.0.0.1", "--no-webui", "-cb"]
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"llama-server exited: {log.read()[-2000:].decode()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become ready")
            time.sleep(0.2)

        def ask(image: bytes, question: str, tokens: int,
                first: threading.Event | None = None) -> Stream:
            url = "data:image/png;base64," + base64.b64encode(image).decode()
            body = json.dumps({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": question}]}], "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "cache_prompt": True})
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1200)
            stream = Stream(start=time.perf_counter())
            conn.request("POST", "/v1/chat/completions", body,
                         {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"llama-server: {response.status} {response.read()!r}")
            for raw in response:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    stream.events.append((time.perf_counter(), 1))
                    if first is not None:
                        first.set()
            stream.end = time.perf_counter()
            return stream

        yield ask
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


# -- the run -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path)
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--systems", default="qvld,qvld-alone,llama-server")
    parser.add_argument("--alone-clients", default="1,4",
                        help="client counts qvld-alone (one generation per infer request, "
                        "the engine before continuous batching) runs at; its extras skipped")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model", default="qwen3-vl-2b-int8",
                        help="qvld's model directory under MODELS (qwen3-vl-2b-int8-ir+onnx: "
                        "the IR plus int8 ONNX graphs)")
    parser.add_argument("--before", type=Path,
                        help="another checkout whose qvld runs as the system qvld@before")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.clients.split(",")]
    systems = args.systems.split(",")
    if args.before is not None and "qvld@before" not in systems:
        systems.insert(1, "qvld@before")
    model = args.models / args.model
    cache = Path(tempfile.mkdtemp(prefix="qvld-conc-cache-"))
    seed = 0
    rows: list[dict[str, Any]] = []

    def start(system: str, n: int) -> Any:
        if system == "llama-server":
            return llama_server(args.models, n)
        if system == "qvld@before":
            return qvld(model, True, n, cache, source=args.before)
        if system == "qvld-openvino":  # OpenVINO decoding whatever auto would choose
            return qvld(model, True, n, cache, settings=("--set", "model.backend=openvino"))
        return qvld(model, system == "qvld", n, cache)

    alone_counts = {int(n) for n in args.alone_clients.split(",")}
    for n in counts:
        for system in systems:
            if system == "qvld-alone" and n not in alone_counts:
                continue
            with start(system, n) as ask:
                seed += 100
                ask(scene(args.size, seed + 99), QUESTIONS[0], 4, None)  # warm-up
                images = [scene(args.size, seed + i) for i in range(n)]
                runs = [summarise(together(ask, images, args.tokens))]
                if n == 1:  # the single-stream figures twice (another image): the median
                    runs.append(summarise(together(ask, [scene(args.size, seed + 90)],
                                                   args.tokens)))
                row = {"system": system, "clients": n,
                       **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
                if n == 4 and system != "qvld-alone":
                    shared = [scene(args.size, seed + 50)] * n
                    row["shared_image_aggregate_tok_s"] = summarise(
                        together(ask, shared, args.tokens))["aggregate_tok_s"]
                    alone = ask(scene(args.size, seed + 60), QUESTIONS[-1], 8, None)
                    row["ttft_alone_s"] = alone.first - alone.start
                    row["ttft_late_s"] = late_arrival(
                        ask, [scene(args.size, seed + 70 + i) for i in range(n)],
                        scene(args.size, seed + 80), args.tokens)
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    print()
    print("| system | clients | aggregate tok/s | TTFT median / p95 s | ms/token while all "
          "decode |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['system']} | {row['clients']} | {row['aggregate_tok_s']:.2f} | "
              f"{row['ttft_median_s']:.2f} / {row['ttft_p95_s']:.2f} | "
              f"{row['ms_per_token_all_decoding']:.0f} |")
    for row in rows:
        if "shared_image_aggregate_tok_s" in row:
            shared, alone = row["shared_image_aggregate_tok_s"], row["ttft_alone_s"]
            print(f"{row['system']} at 4: one shared image {shared:.2f} tok/s; a new "
                  f"request's TTFT alone {alone:.2f} s, while 4 decode "
                  f"{row['ttft_late_s']:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
