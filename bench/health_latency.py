"""`health` round-trip latency while a generation runs on the same daemon.

    python bench/health_latency.py SOCKET [--tokens 64] [--calls 50]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from qvlctl.client import Client


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)
    done = threading.Event()

    def generate() -> None:
        with Client(args.socket) as client:
            client.generate({"messages": [{"role": "user", "content": "Tell me a story."}],
                             "max_tokens": args.tokens, "ignore_eos": True, "temperature": 0})
        done.set()

    idle = []
    with Client(args.socket) as client:
        for _ in range(args.calls):
            t0 = time.perf_counter()
            client.health()
            idle.append(time.perf_counter() - t0)
    worker = threading.Thread(target=generate)
    worker.start()
    busy = []
    with Client(args.socket) as client:
        time.sleep(0.5)
        while not done.is_set() and len(busy) < args.calls:
            t0 = time.perf_counter()
            client.health()
            busy.append(time.perf_counter() - t0)
            time.sleep(0.02)
    worker.join()
    for name, values in (("idle", idle), ("during generation", busy)):
        ms = sorted(v * 1000 for v in values)
        print(f"health {name}: median {statistics.median(ms):.2f} ms, "
              f"p95 {ms[int(len(ms) * 0.95) - 1]:.2f} ms, max {ms[-1]:.2f} ms ({len(ms)} calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
