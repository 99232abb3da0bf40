"""The machine as preflight checks it and tuning acts on it: facts read from /proc and
/sys under a root that tests can point elsewhere, and the choices both derive from them
(the NUMA node to run on). Reads only; changes nothing.
"""

from __future__ import annotations

import re
import resource
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qvld.config import Config


@dataclass
class System:
    """Where the facts come from: the real machine by default."""

    root: Path = Path("/")
    nofile: Callable[[], tuple[int, int]] = field(
        default=lambda: resource.getrlimit(resource.RLIMIT_NOFILE))

    def read(self, path: str) -> str | None:
        try:
            return (self.root / path.lstrip("/")).read_text(errors="replace")
        except OSError:
            return None

    def glob(self, pattern: str) -> list[Path]:
        return sorted(self.root.glob(pattern.lstrip("/")),
                      key=lambda p: [int(n) if n.isdigit() else n
                                     for n in re.split(r"(\d+)", str(p))])

    # -- derived facts ------------------------------------------------------------------

    def cpu_flags(self) -> set[str]:
        from qvld.engine.model.model_dir import cpu_flags

        return cpu_flags(self.read("/proc/cpuinfo") or "")

    def cpu_model(self) -> str:
        match = re.search(r"^model name\s*:\s*(.*)$", self.read("/proc/cpuinfo") or "",
                          re.MULTILINE)
        return match.group(1).strip() if match else "unknown CPU"

    def topology(self) -> list[tuple[int, int, int]]:
        """(cpu, package, core) for every online CPU."""
        cpus = []
        for path in self.glob("/sys/devices/system/cpu/cpu[0-9]*"):
            cpu = int(path.name[3:])
            package = self.read(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id")
            core = self.read(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id")
            if package is None or core is None:
                continue
            cpus.append((cpu, int(package), int(core)))
        return cpus

    def numa_nodes(self) -> dict[int, list[int]]:
        nodes = {}
        for path in self.glob("/sys/devices/system/node/node[0-9]*"):
            cpulist = self.read(f"/sys/devices/system/node/{path.name}/cpulist")
            if cpulist is not None:
                nodes[int(path.name[4:])] = parse_cpu_list(cpulist)
        return nodes

    def meminfo(self) -> dict[str, int]:
        values = {}
        for line in (self.read("/proc/meminfo") or "").splitlines():
            key, _, rest = line.partition(":")
            number = rest.split()
            if number and number[0].isdigit():
                values[key] = int(number[0]) * 1024
        return values


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def choose_node(system: System, config: Config) -> int | None:
    """tuning.numa_node, or (auto) the node with the most physical cores."""
    nodes = system.numa_nodes()
    if not nodes:
        return None
    if isinstance(config.tuning.numa_node, int):
        return config.tuning.numa_node if config.tuning.numa_node in nodes else None
    topo = {cpu: (package, core) for cpu, package, core in system.topology()}

    def physical(node: int) -> int:
        return len({topo.get(cpu, (0, cpu)) for cpu in nodes[node]})

    return max(sorted(nodes), key=physical)
