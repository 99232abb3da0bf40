"""This machine's memory read bandwidth (all cores) and matmul throughput.

    python bench/machine.py

Bandwidth: every core sums its own 512 MiB float32 array (far beyond the caches), all
at once, best of 5; the bytes read over the wall time. Matmul: torch, 2048^3, f32 and
bf16, all cores, best of 5.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from typing import Any

import numpy as np

ARRAY_BYTES = 512 << 20


def _reader(start: Any, done: Any, seconds: Any, index: int) -> None:
    data = np.ones(ARRAY_BYTES // 4, np.float32)
    data.sum()  # fault the pages in before the clock starts
    start.wait()
    t0 = time.perf_counter()
    data.sum()
    seconds[index] = time.perf_counter() - t0
    done.wait()


def read_bandwidth(processes: int, repeats: int = 5) -> float:
    """Bytes per second, summed over ``processes`` readers running at the same time."""
    best = 0.0
    for _ in range(repeats):
        start = multiprocessing.Barrier(processes + 1)
        done = multiprocessing.Barrier(processes + 1)
        seconds = multiprocessing.Array("d", processes)
        workers = [multiprocessing.Process(target=_reader, args=(start, done, seconds, i))
                   for i in range(processes)]
        for w in workers:
            w.start()
        start.wait()
        done.wait()
        for w in workers:
            w.join()
        best = max(best, processes * ARRAY_BYTES / max(seconds[:]))
    return best


def matmul_flops(dtype_name: str, n: int = 2048, repeats: int = 5) -> float:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure() -> dict[str, float]:
    cores = len(os.sched_getaffinity(0))
    return {"cores": cores, "read_bandwidth": read_bandwidth(cores),
            "read_bandwidth_1core": read_bandwidth(1),
            "matmul_f32": matmul_flops("float32"), "matmul_bf16": matmul_flops("bfloat16")}


if __name__ == "__main__":
    print(json.dumps(measure()))
