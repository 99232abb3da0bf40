"""Tuning actions applied at start-up (`tuning.apply`): CPU pinning, NUMA memory
binding, the open-file limit and the CPU governor. Each action reports applied,
skipped (why, and the remedy) or failed (why); none of them stops the daemon."""

from __future__ import annotations

import ctypes
import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path

from qvld.config import Config
from qvld.system import System, choose_node, parse_cpu_list

APPLIED, SKIPPED, FAILED = "applied", "skipped", "failed"
MPOL_BIND = 2


@dataclass(frozen=True)
class Action:
    action: str
    result: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def plan_cpus(system: System, config: Config) -> list[int]:
    """The CPUs to pin to: one logical CPU per physical core of the chosen node."""
    pin = config.tuning.pin_cpus
    if pin is None:
        return []
    if pin != "auto":
        return parse_cpu_list(pin)
    node = choose_node(system, config)
    nodes = system.numa_nodes()
    allowed = set(nodes[node]) if node is not None else None
    seen: set[tuple[int, int]] = set()
    cpus = []
    for cpu, package, core in system.topology():
        if allowed is not None and cpu not in allowed:
            continue
        if (package, core) in seen:
            continue  # an SMT sibling of a core already taken
        seen.add((package, core))
        cpus.append(cpu)
    return cpus


def pin(cpus: list[int]) -> Action:
    if not cpus:
        return Action("pin_cpus", SKIPPED, "tuning.pin_cpus is off")
    try:
        available = os.sched_getaffinity(0)
        chosen = [c for c in cpus if c in available]
        if not chosen:
            return Action("pin_cpus", SKIPPED, f"none of CPUs {cpus} is allowed to this "
                          f"process (allowed: {sorted(available)})")
        os.sched_setaffinity(0, chosen)
    except OSError as exc:
        return Action("pin_cpus", FAILED, f"sched_setaffinity: {exc.strerror}")
    return Action("pin_cpus", APPLIED, f"CPUs {','.join(map(str, chosen))} "
                  f"(one per physical core); {len(chosen)} inference threads")


def bind_memory(system: System, config: Config) -> Action:
    nodes = system.numa_nodes()
    if len(nodes) <= 1:
        return Action("numa_membind", SKIPPED, "one NUMA node: nothing to bind")
    node = choose_node(system, config)
    if node is None:
        return Action("numa_membind", SKIPPED, f"NUMA node {config.tuning.numa_node} "
                      "does not exist")
    mask = ctypes.c_ulong(1 << node)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(238, MPOL_BIND, ctypes.byref(mask), ctypes.c_ulong(node + 2))
    except (OSError, AttributeError) as exc:
        return Action("numa_membind", FAILED, f"set_mempolicy unavailable: {exc}")
    if rc != 0:
        err = ctypes.get_errno()
        return Action("numa_membind", SKIPPED, f"set_mempolicy refused ({os.strerror(err)}); "
                      "remedy: numactl --membind in ExecStart")
    return Action("numa_membind", APPLIED, f"memory bound to node{node}")


def raise_nofile(config: Config) -> Action:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = config.tuning.nofile
    if soft >= want:
        return Action("nofile", SKIPPED, f"soft limit {soft} already >= {want}")
    target = min(want, hard) if hard != resource.RLIM_INFINITY else want
    if target <= soft:
        return Action("nofile", SKIPPED, f"hard limit {hard} < {want}; remedy: "
                      f"LimitNOFILE={want} in the unit")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        return Action("nofile", FAILED, f"setrlimit: {exc}")
    return Action("nofile", APPLIED, f"soft limit {soft} -> {target}")


def set_governor(system: System, config: Config) -> Action:
    if config.tuning.governor == "leave":
        return Action("governor", SKIPPED, "tuning.governor is 'leave'")
    files = system.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor")
    if not files:
        return Action("governor", SKIPPED, "no cpufreq on this machine (the host decides)")
    changed = 0
    for path in files:
        if path.read_text().strip() == "performance":
            continue
        try:
            Path(path).write_text("performance\n")
            changed += 1
        except OSError as exc:
            return Action("governor", SKIPPED, f"{path} is not writable ({exc.strerror}: "
                          "the hardened unit protects kernel tunables); remedy: cpupower "
                          "frequency-set -g performance or tuned-adm profile "
                          "throughput-performance")
    return Action("governor", APPLIED if changed else SKIPPED,
                  f"performance on {changed} CPUs" if changed else "already performance")


def apply(config: Config, system: System | None = None) -> tuple[list[Action], list[int]]:
    """Apply the tuning; returns the actions and the CPUs the process now runs on."""
    system = system or System()
    if not config.tuning.apply:
        return [Action("tuning", SKIPPED, "tuning.apply is off")], []
    cpus = plan_cpus(system, config)
    pinned = pin(cpus)
    actions = [pinned, bind_memory(system, config), raise_nofile(config),
               set_governor(system, config)]
    running = sorted(os.sched_getaffinity(0)) if pinned.result == APPLIED else []
    return actions, running


def dry_run(config: Config, system: System | None = None) -> list[Action]:
    """What `apply` would do, without doing it (for `qvld preflight`)."""
    system = system or System()
    if not config.tuning.apply:
        return [Action("tuning", SKIPPED, "tuning.apply is off")]
    cpus = plan_cpus(system, config)
    node = choose_node(system, config)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return [
        Action("pin_cpus", SKIPPED, f"dry run: would pin to CPUs {','.join(map(str, cpus))}"
               if cpus else "tuning.pin_cpus is off"),
        Action("numa_membind", SKIPPED, f"dry run: would bind memory to node{node}"
               if len(system.numa_nodes()) > 1 else "one NUMA node: nothing to bind"),
        Action("nofile", SKIPPED, f"dry run: soft limit {soft}, target {config.tuning.nofile}"),
        Action("governor", SKIPPED, f"dry run: tuning.governor is {config.tuning.governor!r}"),
    ]
