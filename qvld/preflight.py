"""Read-only checks of the system qvld runs on, each with what was found, why it
matters and the exact remedy. Everything is read through a ``System`` (an injectable
root for /proc and /sys, and the limits), so tests feed recorded trees."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from qvld.config import Config
from qvld.engine.model.compiled_cache import unsafe_dir
from qvld.system import System, choose_node

OK, WARN, FAIL, NA = "ok", "warn", "fail", "n/a"


@dataclass(frozen=True)
class Check:
    id: str
    status: str
    found: str
    why: str
    remedy: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# -- the checks -------------------------------------------------------------------------


def check_cpu_isa(system: System, config: Config) -> Check:
    flags = system.cpu_flags()
    if not flags:
        return Check("cpu_isa", WARN, "no CPU flags in /proc/cpuinfo",
                     "OpenVINO's fast kernels need AVX2 at least",
                     "check that /proc is mounted and readable")
    have = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
                        "amx_tile", "amx_bf16", "amx_int8") if f in flags]
    if "avx2" not in flags:
        return Check("cpu_isa", FAIL, f"{system.cpu_model()}: no AVX2 ({' '.join(have) or 'none'})",
                     "OpenVINO's CPU plugin needs AVX2 for usable speed; without it a 2B "
                     "model answers in minutes",
                     "run qvld on an x86-64 CPU with AVX2 (Intel Haswell / AMD Zen or newer)")
    if "amx_tile" in flags:
        best = "AMX (bf16/int8 matrix tiles)"
    elif "avx512_bf16" in flags:
        best = "AVX-512 with BF16"
    elif "avx512f" in flags:
        best = "AVX-512" + (" VNNI" if "avx512_vnni" in flags else "")
    else:
        best = "AVX2" + (" VNNI" if "avx_vnni" in flags else "")
    return Check("cpu_isa", OK, f"{system.cpu_model()}: {' '.join(have)}; OpenVINO uses {best}",
                 "the widest vector/matrix units decide prefill speed and the default "
                 "precision (bf16 where the CPU has it)")


def check_cpu_governor(system: System, config: Config) -> Check:
    governors = {p.read_text().strip() for p in
                 system.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor")}
    if not governors:
        return Check("cpu_governor", NA, "no cpufreq (usual in VMs: the host decides)",
                     "a power-saving governor lowers clocks between tokens")
    if governors == {"performance"}:
        return Check("cpu_governor", OK, "performance",
                     "a power-saving governor lowers clocks between tokens")
    return Check("cpu_governor", WARN, ", ".join(sorted(governors)),
                 "powersave/schedutil ramp clocks down between decode steps; first tokens "
                 "and tokens/s suffer",
                 "cpupower frequency-set -g performance (or tuned-adm profile "
                 "throughput-performance, or tuning.governor: performance with privileges)")


def check_smt(system: System, config: Config) -> Check:
    topo = system.topology()
    if not topo:
        return Check("smt", NA, "no CPU topology in /sys", "")
    cores = {(p, c) for _, p, c in topo}
    per_core = len(topo) / len(cores)
    if per_core > 1:
        return Check("smt", OK, f"{per_core:.0f} threads per core ({len(topo)} CPUs, "
                     f"{len(cores)} cores)",
                     "SMT siblings share one core's vector units; qvld pins one thread per "
                     "physical core (tuning.pin_cpus: auto)")
    return Check("smt", OK, f"1 thread per core ({len(cores)} cores)",
                 "SMT siblings share one core's vector units")


def check_cpu_topology(system: System, config: Config) -> Check:
    topo = system.topology()
    if not topo:
        return Check("cpu_topology", NA, "no CPU topology in /sys", "")
    packages = sorted({p for _, p, _ in topo})
    cores = {(p, c) for _, p, c in topo}
    return Check("cpu_topology", OK, f"{len(packages)} socket(s), {len(cores)} physical cores, "
                 f"{len(topo)} logical CPUs",
                 "inference threads scale with physical cores, not logical CPUs")


def check_numa(system: System, config: Config) -> Check:
    nodes = system.numa_nodes()
    if not nodes:
        return Check("numa", NA, "no NUMA information in /sys", "")

    node = choose_node(system, config)
    listing = "; ".join(f"node{n}: {len(c)} CPUs" for n, c in nodes.items())
    wanted = config.tuning.numa_node
    if isinstance(wanted, int) and wanted not in nodes:
        # e.g. qvld@1 on a machine with one node: it would run on every CPU instead
        return Check("numa", WARN, f"tuning.numa_node {wanted} does not exist here "
                     f"({listing})", "an instance bound to a missing node is not bound at all",
                     f"run one instance per existing node (qvld@0 .. qvld@{max(nodes)}) or "
                     "set tuning.numa_node to one of them")
    if len(nodes) == 1:
        return Check("numa", OK, f"1 node ({listing})",
                     "threads and memory on one node avoid cross-socket traffic")
    if config.tuning.apply and config.tuning.pin_cpus is not None:
        return Check("numa", OK, f"{len(nodes)} nodes ({listing}); qvld uses node{node}'s "
                     "cores and memory", "cross-node memory reads halve decode bandwidth")
    return Check("numa", WARN, f"{len(nodes)} nodes ({listing}) and no pinning",
                 "threads spread over nodes read weights across the interconnect",
                 "set tuning.apply: true and tuning.pin_cpus: auto (or numactl "
                 "--cpunodebind=0 --membind=0 in ExecStart)")


def check_nofile(system: System, config: Config) -> Check:
    soft, hard = system.nofile()
    want = config.tuning.nofile
    found = f"soft {soft}, hard {hard}; want {want}"
    why = "every client connection and model file holds a descriptor"
    if soft >= want:
        return Check("nofile", OK, found, why)
    if hard >= want:
        return Check("nofile", WARN if not config.tuning.apply else OK,
                     found + (" (tuning raises the soft limit)" if config.tuning.apply else ""),
                     why, "tuning.apply: true raises it, or LimitNOFILE= in the unit")
    return Check("nofile", WARN, found, why,
                 f"LimitNOFILE={want} in the unit (or /etc/security/limits.d)")


def model_bytes(config: Config) -> int:
    path = config.model.path
    if path is None or not path.is_dir():
        return 0
    # The weight files the backend reads: IR .bin files, or ONNX graphs and their data.
    pattern = "onnx_*.onnx*" if backend_of(config) == "onnxruntime" else "openvino_*.bin"
    return sum(p.stat().st_size for p in path.glob(pattern))


PREPARE_THREADS = 2  # the daemon's prepare stage (app.py)


def backend_of(config: Config) -> str:
    """The runtime the daemon will run (``model.backend``, auto resolved as it will)."""
    from qvld.engine.model.model_dir import resolve_backend

    return resolve_backend(config.model)[0]


def video_bytes(config: Config) -> int:
    """What clips being prepared hold at most: per clip of model.video_max_tokens, its
    resized frames (uint8) and its patches (float32), a token being 2 frames x 32x32
    pixels; one clip per prepare thread."""
    tokens = config.model.video_max_tokens
    frames = tokens * 2 * 32 * 32 * 3  # uint8 RGB
    patches = tokens * 2 * 32 * 32 * 3 * 4  # float32, every pixel once
    return PREPARE_THREADS * (frames + patches)


def check_memory(system: System, config: Config) -> Check:
    info = system.meminfo()
    available = info.get("MemAvailable")
    if available is None:
        return Check("memory", NA, "no /proc/meminfo", "")
    weights = model_bytes(config)
    engine = config.engine
    video = video_bytes(config)
    need = weights + ((engine.kv_cache_mb + engine.image_cache_mb + engine.session_image_mb)
                      << 20) + video + (512 << 20)
    found = (f"{_gib(available)} available; needs ≈{_gib(need)} (weights {_gib(weights)}, "
             f"KV cache {engine.kv_cache_mb} MiB, image cache {engine.image_cache_mb} MiB, "
             f"session images {engine.session_image_mb} MiB, videos being prepared "
             f"{video >> 20} MiB, runtime 0.5 GiB)")
    why = "running out of memory gets the daemon killed or swapping mid-answer"
    if available < need:
        return Check("memory", FAIL, found, why,
                     "lower engine.kv_cache_mb / engine.image_cache_mb, use an int4 model, "
                     "or add memory")
    if available < need * 1.25:
        return Check("memory", WARN, found, why, "leave 25 % headroom: lower "
                     "engine.kv_cache_mb or add memory")
    return Check("memory", OK, found, why)


def check_swap(system: System, config: Config) -> Check:
    total = system.meminfo().get("SwapTotal")
    if total is None:
        return Check("swap", NA, "no /proc/meminfo", "")
    if total == 0:
        return Check("swap", OK, "no swap", "paged-out weights stall every token")
    return Check("swap", WARN, f"{_gib(total)} of swap",
                 "under memory pressure the model's pages go to swap and every token stalls",
                 "MemorySwapMax=0 in the unit (or vm.swappiness=1)")


def check_thp(system: System, config: Config) -> Check:
    text = system.read("/sys/kernel/mm/transparent_hugepage/enabled")
    if text is None:
        return Check("thp", NA, "no transparent hugepage control", "")
    match = re.search(r"\[(\w+)\]", text)
    mode = match.group(1) if match else text.strip()
    why = "huge pages cut TLB misses when streaming gigabytes of weights per token"
    if mode == "never":
        return Check("thp", WARN, "never", why,
                     "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled")
    return Check("thp", OK, mode, why)


# The runtime model.backend names: its distribution, and how to install it.
RUNTIMES = {"openvino": ("openvino", "the engine runs on OpenVINO",
                         "pip install openvino==2026.4.1"),
            "onnxruntime": ("onnxruntime", "model.backend is onnxruntime",
                            "pip install 'qvld[onnxruntime]' (onnxruntime==1.32.0)")}


def check_python(system: System, config: Config) -> Check:
    """The configured backend's runtime is installed, by its package metadata: the check
    never loads a runtime (with the ONNX backend, the daemon never loads OpenVINO)."""
    version = ".".join(map(str, sys.version_info[:3]))
    name, why, remedy = RUNTIMES[backend_of(config)]
    try:
        if importlib.util.find_spec(name) is None:
            raise importlib.metadata.PackageNotFoundError(name)
        runtime = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return Check("python", FAIL, f"Python {version}, {name} missing", why, remedy)
    return Check("python", OK, f"Python {version}, {name} {runtime}",
                 "the runtime versions decide the kernels used")


def check_glibc(system: System, config: Config) -> Check:
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        text = ""
    match = re.search(r"(\d+)\.(\d+)", text)
    if not match:
        return Check("glibc", NA, text or "not glibc", "OpenVINO wheels are built for glibc")
    if (int(match.group(1)), int(match.group(2))) < (2, 28):
        return Check("glibc", FAIL, text, "OpenVINO wheels need glibc 2.28+",
                     "use a newer distribution (Debian 10+, Ubuntu 18.10+, RHEL 8+)")
    return Check("glibc", OK, text, "OpenVINO wheels need glibc 2.28+")


def check_model(system: System, config: Config) -> Check:
    from qvld.engine.model.model_dir import GRAPHS, SUBMODELS, load_model_spec
    from qvld.errors import ModelInvalid

    path = config.model.path
    if path is None:
        return Check("model", FAIL, "model.path is not set", "there is nothing to serve",
                     "set model.path (or qvld --model DIR)")
    backend = backend_of(config)
    graph, command = GRAPHS[backend]
    try:
        spec = load_model_spec(path, backend)
    except ModelInvalid as exc:
        fix = f"convert the model again: {command}"
        if backend == "openvino":
            fix += " (or optimum-cli export openvino --task image-text-to-text)"
        return Check("model", FAIL, str(exc), "the daemon cannot load this directory", fix)
    for sub in SUBMODELS:
        main = graph(path, sub)
        # An IR's weights are in its .bin; an ONNX graph holds them (or a .data beside it).
        weights = main.with_suffix(".bin") if backend == "openvino" else main
        if not os.access(main, os.R_OK) or not weights.is_file() or \
                weights.stat().st_size == 0:
            return Check("model", FAIL, f"{weights.name} is missing, empty or unreadable",
                         "the daemon cannot load this directory",
                         "convert the model again, or fix the file permissions")
    return Check("model", OK, f"{spec.name}: {_gib(model_bytes(config))} of weights at {path}",
                 "the model directory must be complete and readable by the daemon")


def _dir_check(name: str, path: Path, why: str, remedy: str) -> Check:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if path.exists() and not path.is_dir():
        return Check(name, FAIL, f"{path} is not a directory", why, remedy)
    if not os.access(probe, os.W_OK | os.X_OK):
        return Check(name, FAIL, f"{probe} is not writable by uid {os.getuid()}", why, remedy)
    return Check(name, OK, f"{path} {'exists' if path.exists() else 'can be created'}", why)


def check_socket_dir(system: System, config: Config) -> Check:
    return _dir_check("socket_dir", config.server.socket.parent,
                      "the daemon creates its socket there",
                      "RuntimeDirectory=qvld in the unit (or a tmpfiles.d entry)")


def check_cache_dir(system: System, config: Config) -> Check:
    if config.model.cache_dir is None:
        return Check("cache_dir", WARN, "model.cache_dir is not set",
                     "a compiled-model cache makes restarts reach READY much sooner",
                     "set model.cache_dir (e.g. /var/cache/qvld, CacheDirectory=qvld)")
    why = "OpenVINO keeps compiled models there"
    check = _dir_check("cache_dir", config.model.cache_dir, why,
                       "CacheDirectory=qvld in the unit")
    problem = unsafe_dir(config.model.cache_dir) if check.status == OK and \
        config.model.cache_dir.is_dir() else None
    if problem is not None:  # the engine will not use it (see qvld/engine/model/compiled_cache.py)
        return Check("cache_dir", WARN, f"{problem[0]}: compiled models would not be cached",
                     why + "; a cache others can write could replace what the daemon runs",
                     problem[1])
    return check


def check_tmp(system: System, config: Config) -> Check:
    tmp = Path(tempfile.gettempdir())
    try:
        with tempfile.NamedTemporaryFile(dir=tmp):
            pass
    except OSError as exc:
        return Check("tmp", FAIL, f"{tmp} is not writable: {exc.strerror}",
                     "OpenVINO and Python write temporary files", "PrivateTmp=yes in the unit")
    free = shutil.disk_usage(tmp).free
    if free < 256 << 20:
        return Check("tmp", WARN, f"{tmp}: {_gib(free)} free",
                     "OpenVINO and Python write temporary files", f"free space in {tmp}")
    return Check("tmp", OK, f"{tmp}: {_gib(free)} free",
                 "OpenVINO and Python write temporary files")


CHECKS: tuple[Callable[[System, Config], Check], ...] = (
    check_cpu_isa, check_cpu_governor, check_smt, check_cpu_topology, check_numa,
    check_nofile, check_memory, check_swap, check_thp, check_python, check_glibc,
    check_model, check_socket_dir, check_cache_dir, check_tmp,
)


def run_checks(config: Config, system: System | None = None) -> list[Check]:
    system = system or System()
    results = []
    for check in CHECKS:
        try:
            results.append(check(system, config))
        except Exception as exc:  # a check must never take the daemon down
            name = check.__name__.removeprefix("check_")
            results.append(Check(name, WARN, f"the check itself failed: {exc!r}",
                                 "qvld could not inspect this", "report it as a bug"))
    return results


def report(checks: list[Check], tuning: list[dict[str, str]]) -> dict[str, Any]:
    """The `qvld preflight --json` document (shape fixed in DESIGN.md)."""
    return {"ok": all(c.status != FAIL for c in checks),
            "checks": [c.to_dict() for c in checks], "tuning": tuning}


def textfile(checks: list[Check]) -> str:
    """node_exporter textfile-collector format."""
    lines = ["# HELP qvld_preflight_check Preflight checks: 1 for the status each has.",
             "# TYPE qvld_preflight_check gauge"]
    for check in checks:
        for status in (OK, WARN, FAIL, NA):
            value = 1 if check.status == status else 0
            lines.append(f'qvld_preflight_check{{check="{check.id}",status="{status}"}} '
                         f"{value}")
    return "\n".join(lines) + "\n"
