"""Peak memory of a command and every process it starts (a model export, a daemon).

    python bench/peak_memory.py [--limit-gb 8] -- qvlctl model export-onnx HF DIR --weights int8

Samples ``/proc/PID/status`` of the command's process tree every 50 ms and prints the
peaks of the tree's summed anonymous memory (what only swap or the OOM killer can take
back) and of its summed resident memory (anonymous + mapped files + shared). With
``--limit-gb`` the command runs in a memory cgroup (v1) capped there, as a small server
would be: it must finish inside it (the kernel reclaims page cache first, and kills the
command when anonymous memory does not fit); the cgroup's own peak is printed too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def tree_memory(root: psutil.Process) -> tuple[int, int]:
    """(anonymous, resident) bytes of ``root`` and its descendants now."""
    anon = rss = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for proc in procs:
        try:
            fields = dict(line.split(":", 1) for line in
                          Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                          if line.startswith(("RssAnon", "VmRSS")))
        except (OSError, ValueError):
            continue
        anon += int(fields.get("RssAnon", "0 kB").split()[0]) * 1024
        rss += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    return anon, rss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gb", type=float, help="run in a memory cgroup capped here")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    group = None
    if args.limit_gb:
        group = CGROUP_V1 / f"qvld-peak-{os.getpid()}"
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(int(args.limit_gb * 2 ** 30)))
        (group / "memory.memsw.limit_in_bytes").write_text(str(int(args.limit_gb * 2 ** 30))) \
            if (group / "memory.memsw.limit_in_bytes").exists() else None

    def enter() -> None:
        if group is not None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    started = time.monotonic()
    proc = subprocess.Popen(command, preexec_fn=enter)  # into the cgroup before exec
    root = psutil.Process(proc.pid)
    peak_anon = peak_rss = 0
    shown = 0  # the timeline: a line each time anonymous memory passes another GB
    while proc.poll() is None:
        anon, rss = tree_memory(root)
        peak_anon, peak_rss = max(peak_anon, anon), max(peak_rss, rss)
        if anon >= (shown + 1) * 1e9:
            shown = int(anon // 1e9)
            print(f"  {time.monotonic() - started:6.1f} s: anonymous {anon / 1e9:.2f} GB",
                  file=sys.stderr, flush=True)
        time.sleep(0.05)
    took = time.monotonic() - started
    gb = 1e9
    print(f"exit {proc.returncode} after {took:.0f} s; peak anonymous {peak_anon / gb:.2f} GB, "
          f"peak resident {peak_rss / gb:.2f} GB (the process tree, sampled every 50 ms)",
          file=sys.stderr)
    if group is not None:
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        print(f"inside a memory cgroup limited to {args.limit_gb} GiB: its peak "
              f"{peak / gb:.2f} GB (page cache included: the kernel reclaims it there)",
              file=sys.stderr)
        deadline = time.monotonic() + 30
        while True:  # the last of the tree may still be leaving it
            try:
                group.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    print(f"could not remove {group}", file=sys.stderr)
                    break
                time.sleep(0.2)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
