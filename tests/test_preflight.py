"""Preflight checks and tuning plans on recorded and constructed /proc and /sys trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qvld.config import Config
from qvld.config_loading import load_config
from qvld.preflight import run_checks, textfile
from qvld.system import System, choose_node
from qvld.tuning import plan_cpus, raise_nofile, set_governor
from tests.conftest import FIXTURES, TINY

THIS_MACHINE = FIXTURES / "systems" / "this-machine"
SERVER_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma avx512f avx512bw avx512_vnni"


def build_tree(root: Path, sockets: int, cores: int, threads: int, flags: str,
               mem_gib: float, governor: str | None = None, thp: str = "madvise") -> Path:
    """A /proc + /sys tree in Linux's layout: CPUs numbered core-major like the kernel
    does on Intel servers (siblings are cpu N and N + sockets*cores)."""
    total_cores = sockets * cores
    per_node: dict[int, list[int]] = {}
    for thread in range(threads):
        for socket in range(sockets):
            for core in range(cores):
                cpu = thread * total_cores + socket * cores + core
                topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
                topo.mkdir(parents=True)
                (topo / "physical_package_id").write_text(f"{socket}\n")
                (topo / "core_id").write_text(f"{core}\n")
                if governor is not None:
                    freq = root / f"sys/devices/system/cpu/cpu{cpu}/cpufreq"
                    freq.mkdir(parents=True)
                    (freq / "scaling_governor").write_text(f"{governor}\n")
                per_node.setdefault(socket, []).append(cpu)
    for node, cpus in per_node.items():
        path = root / f"sys/devices/system/node/node{node}"
        path.mkdir(parents=True)
        (path / "cpulist").write_text(",".join(map(str, sorted(cpus))) + "\n")
    proc = root / "proc"
    proc.mkdir(parents=True)
    (proc / "cpuinfo").write_text(
        "".join(f"processor\t: {i}\nmodel name\t: Test CPU\nflags\t\t: {flags}\n\n"
                for i in range(total_cores * threads)))
    kb = int(mem_gib * 2**20)
    (proc / "meminfo").write_text(f"MemTotal:       {kb} kB\nMemAvailable:   {kb} kB\n"
                                  "SwapTotal:      0 kB\n")
    mm = root / "sys/kernel/mm/transparent_hugepage"
    mm.mkdir(parents=True)
    (mm / "enabled").write_text(f"always [{thp}] never\n" if thp != "never"
                                else "always madvise [never]\n")
    return root


def config(**sets: str) -> Config:
    return load_config(None, [f"model.path={TINY}", *(f"{k}={v}" for k, v in sets.items())])


def by_id(checks: list) -> dict[str, object]:  # type: ignore[type-arg]
    return {c.id: c for c in checks}


def test_this_machine_recorded() -> None:
    system = System(root=THIS_MACHINE, nofile=lambda: (20000, 20000))
    checks = by_id(run_checks(config(), system))
    assert checks["cpu_isa"].status == "ok" and "avx512" in checks["cpu_isa"].found
    assert checks["cpu_governor"].status == "n/a"
    assert checks["smt"].found.startswith("1 thread per core (2 cores)")
    assert checks["numa"].status == "ok"
    assert checks["nofile"].status == "warn" and "LimitNOFILE=65536" in checks["nofile"].remedy
    assert checks["memory"].status == "ok"
    assert checks["model"].status == "ok"
    assert plan_cpus(system, config()) == [0, 1]
    for check in checks.values():
        if check.status in ("warn", "fail"):
            assert check.remedy, check.id


def test_two_socket_smt_powersave(tmp_path: Path) -> None:
    system = System(root=build_tree(tmp_path, sockets=2, cores=8, threads=2,
                                    flags=SERVER_FLAGS, mem_gib=256, governor="powersave"),
                    nofile=lambda: (1024, 1048576))
    checks = by_id(run_checks(config(), system))
    assert checks["cpu_governor"].status == "warn"
    assert "cpupower frequency-set -g performance" in checks["cpu_governor"].remedy
    assert checks["smt"].found.startswith("2 threads per core (32 CPUs, 16 cores)")
    assert checks["cpu_topology"].found == "2 socket(s), 16 physical cores, 32 logical CPUs"
    assert checks["numa"].status == "ok" and "node0" in checks["numa"].found
    assert checks["nofile"].status == "ok"  # tuning raises the soft limit
    # One node's physical cores only: no SMT siblings (16-23), nothing of node 1 (8-15).
    assert plan_cpus(system, config()) == list(range(8))
    assert plan_cpus(system, config(**{"tuning.numa_node": "1"})) == list(range(8, 16))
    assert choose_node(system, config()) == 0
    unpinned = by_id(run_checks(config(**{"tuning.pin_cpus": ""}), system))
    assert unpinned["numa"].status == "warn" and "numactl" in unpinned["numa"].remedy
    # an instance for a node the machine lacks (qvld@2 here) is told so
    missing = by_id(run_checks(config(**{"tuning.numa_node": "2"}), system))["numa"]
    assert missing.status == "warn" and "tuning.numa_node 2 does not exist" in missing.found
    assert "qvld@0 .. qvld@1" in missing.remedy


def test_cpu_without_avx2_fails_clearly(tmp_path: Path) -> None:
    system = System(root=build_tree(tmp_path, 1, 4, 1, "fpu sse sse2 avx", mem_gib=16))
    check = by_id(run_checks(config(), system))["cpu_isa"]
    assert check.status == "fail"
    assert "no AVX2" in check.found and "AVX2" in check.remedy


def test_too_little_memory_for_the_model_fails(tmp_path: Path) -> None:
    system = System(root=build_tree(tmp_path, 1, 4, 1, SERVER_FLAGS, mem_gib=4))
    # The full-size int8 model needs ≈2.3 GB of weights; with the default caches and
    # runtime headroom that is more than 4 GiB can hold.
    cfg = config(**{"engine.kv_cache_mb": "2048"})
    fake_model = tmp_path / "model"
    fake_model.mkdir()
    (fake_model / "openvino_language_model.bin").write_bytes(b"")
    os.truncate(fake_model / "openvino_language_model.bin", 2_400_000_000)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": fake_model})})
    check = by_id(run_checks(cfg, system))["memory"]
    assert check.status == "fail" and "4.0 GiB available" in check.found
    assert "int4" in check.remedy


def test_thp_never_and_swap_warn(tmp_path: Path) -> None:
    root = build_tree(tmp_path, 1, 2, 1, SERVER_FLAGS, mem_gib=16, thp="never")
    (root / "proc/meminfo").write_text("MemAvailable: 16000000 kB\nSwapTotal: 4000000 kB\n")
    checks = by_id(run_checks(config(), System(root=root)))
    assert checks["thp"].status == "warn" and checks["swap"].status == "warn"


def test_governor_action(tmp_path: Path) -> None:
    cfg = config(**{"tuning.governor": "performance"})
    root = build_tree(tmp_path / "a", 1, 2, 1, SERVER_FLAGS, mem_gib=16, governor="powersave")
    action = set_governor(System(root=root), cfg)
    assert action.result == "applied" and action.detail == "performance on 2 CPUs"
    assert (root / "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor").read_text() == (
        "performance\n")
    # Under the hardened unit sysfs is read-only: skipped, with the remedy.
    locked = build_tree(tmp_path / "b", 1, 1, 1, SERVER_FLAGS, mem_gib=16, governor="powersave")
    governor = locked / "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"
    governor.unlink()
    governor.symlink_to("/proc/version")  # not writable, even for root
    action = set_governor(System(root=locked), cfg)
    assert action.result == "skipped" and "cpupower" in action.detail
    vm = build_tree(tmp_path / "c", 1, 2, 1, SERVER_FLAGS, mem_gib=8)
    assert set_governor(System(root=vm), cfg).detail.startswith("no cpufreq")
    assert set_governor(System(root=vm), config()).result == "skipped"


def test_nofile_is_raised_within_the_hard_limit() -> None:
    code = ("import resource; from qvld.config import Config; from qvld.tuning import "
            "raise_nofile\nresource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))\n"
            "a = raise_nofile(Config())\nprint(a.result, resource.getrlimit("
            "resource.RLIMIT_NOFILE)[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["applied", "4096"]
    assert raise_nofile(config(**{"tuning.nofile": "64"})).result == "skipped"


def test_pinning_applies_in_a_child_process() -> None:
    code = ("import os; from qvld.config import Config; from qvld.tuning import apply\n"
            "actions, cpus = apply(Config())\nprint(cpus, actions[0].result)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert "applied" in out.stdout


def test_textfile_format() -> None:
    system = System(root=THIS_MACHINE, nofile=lambda: (65536, 65536))
    text = textfile(run_checks(config(), system))
    assert 'qvld_preflight_check{check="cpu_isa",status="ok"} 1' in text
    assert 'qvld_preflight_check{check="cpu_isa",status="fail"} 0' in text


def test_qvld_preflight_command(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "qvld.cli", "preflight", "--json", "--config",
                          "/dev/null", "--model", str(TINY), "--textfile",
                          str(tmp_path / "qvld.prom")], capture_output=True, text=True,
                         check=False)
    document = json.loads(out.stdout)
    assert set(document) == {"ok", "checks", "tuning"}
    assert out.returncode == (0 if document["ok"] else 1)
    for check in document["checks"]:
        assert set(check) == {"id", "status", "found", "why", "remedy"}
        assert check["status"] in ("ok", "warn", "fail", "n/a")
        if check["status"] in ("warn", "fail"):
            assert check["remedy"]
    assert {a["result"] for a in document["tuning"]} <= {"applied", "skipped", "failed"}
    assert "qvld_preflight_check" in (tmp_path / "qvld.prom").read_text()
    missing = subprocess.run([sys.executable, "-m", "qvld.cli", "preflight", "--config",
                              "/dev/null", "--model", str(tmp_path / "none")],
                             capture_output=True, text=True, check=False)
    assert missing.returncode == 1 and "fail  model" in missing.stdout


@pytest.fixture(scope="module")
def tuned_daemon(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from tests.conftest import Daemon

    daemon = Daemon(tmp_path_factory.mktemp("tuned"), args=["--set", "tuning.apply=true"])
    daemon.start()
    yield daemon
    daemon.stop()


def test_daemon_reports_applied_tuning(tuned_daemon) -> None:  # type: ignore[no-untyped-def]
    out = tuned_daemon.qvlctl("preflight", "--json")
    document = json.loads(out.stdout)
    pin = next(a for a in document["tuning"] if a["action"] == "pin_cpus")
    assert pin["result"] == "applied"
    with tuned_daemon.client() as client:
        status = client.status()
    assert status["pinned_cpus"] and status["threads"] == len(status["pinned_cpus"])
    assert status["preflight"]["cpu_isa"] == "ok"
    assert "tuning pin_cpus: applied" in tuned_daemon.log()
    metrics = tuned_daemon.qvlctl("metrics").stdout.decode()
    assert 'qvld_preflight_check{check="cpu_isa",status="ok"} 1.0' in metrics


def test_model_and_runtime_checks_follow_the_backend(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    system = System(root=build_tree(tmp_path / "root", 1, 4, 1, SERVER_FLAGS, mem_gib=16))
    checks = by_id(run_checks(config(**{"model.backend": "onnxruntime"}), system))
    assert checks["model"].status == "ok" and checks["python"].status == "ok"
    assert "onnxruntime" in checks["python"].found
    # The graphs' bytes count as the model's weights (the memory check reads them).
    from qvld.preflight import model_bytes

    onnx_cfg = config(**{"model.backend": "onnxruntime"})
    assert model_bytes(onnx_cfg) == sum(p.stat().st_size for p in TINY.glob("onnx_*.onnx"))
    # An IR-only directory: the model check names the command that writes the graphs.
    ir_only = tmp_path / "ir-only"
    shutil.copytree(TINY, ir_only, ignore=shutil.ignore_patterns("onnx_*"))
    cfg = load_config(None, [f"model.path={ir_only}", "model.backend=onnxruntime"])
    check = by_id(run_checks(cfg, system))["model"]
    assert check.status == "fail" and "qvlctl model export-onnx" in check.remedy
    # Without onnxruntime installed the runtime check fails with the install command.
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    check = by_id(run_checks(onnx_cfg, system))["python"]
    assert check.status == "fail" and "qvld[onnxruntime]" in check.remedy


def test_a_cache_dir_others_can_write_is_a_warning_with_the_remedy(tmp_path: Path) -> None:
    system = System(root=build_tree(tmp_path / "root", 1, 4, 1, SERVER_FLAGS, mem_gib=64))
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)  # the engine refuses it (a blob could be replaced under it)
    check = by_id(run_checks(config(**{"model.cache_dir": str(cache)}), system))["cache_dir"]
    assert check.status == "warn" and "writable by others" in check.found
    assert "chmod" in check.remedy
    cache.chmod(0o755)
    check = by_id(run_checks(config(**{"model.cache_dir": str(cache)}), system))["cache_dir"]
    assert check.status == "ok"


def test_memory_counts_the_session_image_budget(tmp_path: Path) -> None:
    system = System(root=build_tree(tmp_path, 1, 4, 1, SERVER_FLAGS, mem_gib=64))
    small = by_id(run_checks(config(**{"engine.session_image_mb": "0"}), system))["memory"]
    large = by_id(run_checks(config(**{"engine.session_image_mb": "4096"}), system))["memory"]
    assert "session images 4096 MiB" in large.found
    needs = [float(c.found.split("needs ≈")[1].split()[0]) for c in (small, large)]
    assert needs[1] - needs[0] == pytest.approx(4.0, abs=0.05)


def test_memory_counts_the_video_budget(tmp_path: Path) -> None:
    system = System(root=build_tree(tmp_path, 1, 4, 1, SERVER_FLAGS, mem_gib=64))
    small = by_id(run_checks(config(**{"model.video_max_tokens": "16"}), system))["memory"]
    large = by_id(run_checks(config(**{"model.video_max_tokens": "32768"}), system))["memory"]
    # Two clips at once, each 32768 tokens of 2 frames x 32x32 pixels, uint8 + float32.
    assert "videos being prepared 1920 MiB" in large.found
    assert "videos being prepared 0 MiB" in small.found
    needs = [float(c.found.split("needs ≈")[1].split()[0]) for c in (small, large)]
    assert needs[1] - needs[0] == pytest.approx(1.875, abs=0.05)
