"""Record the /proc and /sys files qvld's preflight reads, for tests.

    python tools/record_system.py OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

FILES = ["proc/cpuinfo", "proc/meminfo", "sys/kernel/mm/transparent_hugepage/enabled"]
GLOBS = ["sys/devices/system/cpu/cpu[0-9]*/topology/physical_package_id",
         "sys/devices/system/cpu/cpu[0-9]*/topology/core_id",
         "sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor",
         "sys/devices/system/node/node[0-9]*/cpulist"]


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    root = Path("/")
    paths = [root / f for f in FILES] + [p for g in GLOBS for p in root.glob(g)]
    for path in paths:
        if path.is_file():
            target = out / path.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
