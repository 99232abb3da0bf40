"""Several instances or one: two qvld pinned to one core each against one qvld on both
cores, at the same number of concurrent clients, full-size int8, in one run.

    python bench/scaleout.py MODELS [--clients 4] [--tokens 128] [--size 448]
                                    [--rounds 2] [--json OUT]

MODELS is the directory `make bench-int8` fills (~/.cache/qvld-bench). Each layout runs
`rounds` times, interleaved (one, two, one, two: a noisy machine hits both alike). The
clients are released together, each with its own image and question, streamed, eos
ignored; with two instances client i asks instance i mod 2 (what a least-connections
balancer does with equal requests). Reported per layout: aggregate tokens/s (all tokens
over the wall time from the first request to the last answer), TTFT median, ms/token
while all streams decode, and the resident memory of the daemons together.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from concurrency import QUESTIONS, Stream, summarise  # noqa: E402
from scenes import scene  # noqa: E402
from systems import _start_daemon, peak_rss  # noqa: E402


@contextmanager
def instance(model: Path, cpus: list[int], cache: Path) -> Iterator[tuple[Path, int]]:
    """One qvld confined to ``cpus`` (taskset) with as many inference threads; its
    socket and pid."""
    workdir = Path(tempfile.mkdtemp(prefix="qvld-scale-"))
    proc, _ = _start_daemon(model, workdir, cache, (
        "--set", f"engine.threads={len(cpus)}", "--set", "engine.infer_requests=4",
        "--set", "server.queue_max=64"), prefix=("taskset", "-c", ",".join(map(str, cpus))))
    try:
        yield workdir / "qvld.sock", proc.pid
    finally:
        proc.terminate()
        proc.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)


def ask(sock: Path, image: bytes, question: str, tokens: int) -> Stream:
    from qvlctl.client import Client

    with Client(sock, timeout=1200) as client:
        stream = Stream(start=time.perf_counter())

        def on_token(text: str, ids: list[int]) -> None:
            if ids:
                stream.events.append((time.perf_counter(), len(ids)))

        client.generate({"messages": [{"role": "user", "content": [
            {"type": "image", "image": image}, {"type": "text", "text": question}]}],
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True}, on_token=on_token)
        stream.end = time.perf_counter()
        return stream


def run_layout(model: Path, layout: list[list[int]], clients: int, tokens: int, size: int,
               seed: int, cache: Path) -> dict[str, Any]:
    with ExitStack() as stack:
        daemons = [stack.enter_context(instance(model, cpus, cache)) for cpus in layout]
        for i, (sock, _) in enumerate(daemons):  # warm-up, one short answer each
            ask(sock, scene(size, seed + 90 + i), QUESTIONS[0], 4)
        images = [scene(size, seed + i) for i in range(clients)]
        barrier = threading.Barrier(clients)
        streams: list[Stream | None] = [None] * clients

        def client(i: int) -> None:
            barrier.wait()
            streams[i] = ask(daemons[i % len(daemons)][0], images[i],
                             QUESTIONS[i % len(QUESTIONS)], tokens)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rss = sum(peak_rss(pid) for _, pid in daemons)
        done = [s for s in streams if s is not None]
        assert len(done) == clients and all(s.tokens == tokens for s in done)
        return {**summarise(done), "peak_rss_mib": rss / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", type=Path)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        parser.error("needs two CPUs")
    layouts = {"one qvld on 2 cores": [cpus], "two qvld on 1 core each": [[c] for c in cpus]}
    model = args.models / "qwen3-vl-2b-int8"
    cache = Path(tempfile.mkdtemp(prefix="qvld-scale-cache-"))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
    for round_ in range(args.rounds):
        for name, layout in layouts.items():
            row = run_layout(model, layout, args.clients, args.tokens, args.size,
                             100 * round_, cache)
            results[name].append(row)
            print(json.dumps({"layout": name, "round": round_,
                              **{k: round(v, 3) for k, v in row.items()}}), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    print(f"\n| layout ({args.clients} clients, {args.tokens} tokens, {args.size}x{args.size}) "
          "| aggregate tok/s | TTFT median s | ms/token while all decode | RSS MiB |")
    print("|---|---|---|---|---|")
    summary = {}
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        summary[name] = med
        print(f"| {name} | {med['aggregate_tok_s']:.2f} | {med['ttft_median_s']:.2f} | "
              f"{med['ms_per_token_all_decoding']:.0f} | {med['peak_rss_mib']:.0f} |")
    one, two = (summary[n]["aggregate_tok_s"] for n in layouts)
    print(f"two instances / one: {two / one:.2f}x aggregate tokens/s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
