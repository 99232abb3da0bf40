from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import pytest

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine
from qvld.engine.runners import Generation

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "models" / "tiny"
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 30, what: str = "",
             interval: float = 0.02, detail: Callable[[], str] | None = None) -> T:
    """Poll ``predicate`` until it returns something true, and return that. Tests wait
    on what they need to have happened, never on a fixed sleep: a loaded machine only
    makes them slower. On timeout the test fails naming ``what`` (and ``detail()``,
    such as the daemon's log)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            pytest.fail(f"not within {timeout} s: {what or predicate}{extra}")
        time.sleep(interval)  # the polling interval


def free_port() -> int:
    """A TCP port free on loopback now (for a metrics listener)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def free_port_pair() -> int:
    """A port P such that P and P + 1 are both free on loopback now: the HTTP ports of
    instances 0 and 1 of the template units (the shared port moved up by the number)."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    while True:
        base = free_port()
        if base < 65535 and free(base + 1):
            return base


# (sample name, sorted labels) -> value, as Prometheus' own text parser reads them.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def parity_config(path: Path, backend: str = "openvino", **engine: Any) -> Config:
    """f32 compute and f32 KV cache: the setting whose ids must equal transformers'."""
    return Config(
        model=ModelConfig(path=path, precision="f32", kv_cache_precision="f32",
                          backend=backend),  # type: ignore[arg-type]
        engine=EngineConfig(**{"infer_requests": 2, **engine}),
    )


class StepGate:
    """Holds an engine's step loop between two steps, so a test can set up what must
    happen there (another user's request waiting, say) however slow the machine:
    ``gate.hold_when(predicate)`` returns once the loop, after the first step at whose
    end ``predicate()`` is true, holds its steps (the predicate is checked on the step
    thread, so nothing runs on between); ``gate.release()`` (or leaving the ``with``)
    lets it go on. A held loop still takes requests and cancels in (``StepLoop.hold``),
    so what waits shows in ``batch.view``."""

    def __init__(self, engine: Engine) -> None:
        assert engine.batch is not None, "a step gate needs continuous batching"
        self.batch = engine.batch
        self.previous = self.batch.on_step
        self.until: Callable[[], bool] | None = None
        self.held = threading.Event()  # the loop holds its steps

    def _on_step(self, sequences: int, prefill_rows: int) -> None:
        if self.previous is not None:
            self.previous(sequences, prefill_rows)
        if self.until is not None and self.until():
            self.until = None
            self.batch.hold()
            self.held.set()

    def hold_when(self, predicate: Callable[[], bool], timeout: float = 30,
                  what: str = "") -> None:
        """Until the loop holds its steps after a step at whose end ``predicate()``
        held; a loop held now goes on to its next step first."""
        self.held.clear()
        self.until = predicate
        self.batch.release()
        if not self.held.wait(timeout):
            pytest.fail(f"not within {timeout} s: {what or predicate}")

    def release(self) -> None:
        self.until = None
        self.batch.release()

    def start_together(self, starts: list[Callable[[], Generation]],
                       tokens: int = 5) -> list[Generation]:
        """Start generations that must decode side by side, and hold the step loop once
        each has decoded more than ``tokens`` tokens and all still run. The first is
        held after its first token; the others, started then, are let in once they wait
        in the scheduler's queue and held again once admitted until their prompts
        (prefilled on another runtime, maybe) are in: on a loaded machine a short one
        would otherwise finish while a later one still encodes or prefills."""
        batch = self.batch

        def holds(gens: list[Generation], place: int) -> bool:
            seqs = batch.view[place]
            return all(g.seq is not None and any(s is g.seq for s in seqs) for g in gens)

        first = starts[0]()
        self.hold_when(lambda: first.seq is not None and first.seq.generated >= 1,
                       what="the first generation to decode")
        others = [start() for start in starts[1:]]
        wait_for(lambda: holds(others, 1), 60, "the others to wait for a place")
        self.hold_when(lambda: holds(others, 0), what="the others to be admitted")
        wait_for(lambda: all(g.seq is not None and not g.seq.outside for g in others), 60,
                 "the others' prompts prefilled on the other runtime")
        gens = [first, *others]
        self.hold_when(lambda: holds(gens, 0) and all(
            g.seq is not None and g.seq.generated > tokens for g in gens),
            what=f"every generation to decode {tokens} tokens side by side")
        return gens

    def __enter__(self) -> StepGate:
        self.batch.on_step = self._on_step
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.batch.on_step = self.previous


def reused(engine: Engine, rows: int) -> int:
    """The KV rows ``engine`` reuses of a cached prefix of ``rows`` rows: all of them on a
    slot of its own, whole blocks with continuous batching (its prefix cache keeps full
    blocks only)."""
    if engine.blocks is None:
        return rows
    return rows // engine.blocks.block_size * engine.blocks.block_size


def load_reference(path: Path) -> dict[str, Any]:
    return dict(json.loads((path / "reference.json").read_text(encoding="utf-8")))


def outdate_onnx_graphs(model: Path, key: str = "qvld.kv_cache") -> None:
    """The directory's language-model graph as an older qvld exported it, without the
    metadata ``key``: ``qvld.kv_cache`` (its KV cache written in place) or
    ``qvld.int8_activations`` (an int8 graph's activations quantised per row)."""
    import onnx

    path = model / "onnx_language_model.onnx"
    graph = onnx.load(str(path), load_external_data=False)
    kept = [p for p in graph.metadata_props if p.key != key]
    del graph.metadata_props[:]
    graph.metadata_props.extend(kept)
    onnx.save_model(graph, str(path))


def with_image_bytes(messages: list[dict[str, Any]], model_dir: Path) -> list[dict[str, Any]]:
    """Reference messages name image and video files; the engine takes their bytes."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": (model_dir / "images" / part["image"]).read_bytes()}
                if part["type"] == "image" else
                {"type": "video", "video": (model_dir / "images" / part["video"]).read_bytes()}
                if part["type"] == "video" else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def tiny_engine() -> Iterator[Engine]:
    yield Engine(parity_config(TINY, prefill_chunk=64))


@pytest.fixture(scope="session")
def tiny_reference() -> dict[str, Any]:
    return load_reference(TINY)


class Daemon:
    """The real `qvld` process on a real Unix socket, started from the command line."""

    def __init__(self, workdir: Path, model: Path = TINY, args: Sequence[str] = (),
                 config_text: str = "", socket_path: Path | None = None,
                 metrics_listen: str = "", env: dict[str, str] | None = None) -> None:
        self.env = None if env is None else {**os.environ, **env}
        self.workdir = workdir
        self.socket = socket_path or workdir / "qvld.sock"
        self.log_path = workdir / "qvld.log"
        config = workdir / "qvld.yaml"
        config.write_text(config_text)
        self.argv = [sys.executable, "-m", "qvld.cli", "--config", str(config),
                     "--model", str(model), "--socket", str(self.socket),
                     "--set", "model.precision=f32", "--set", "model.kv_cache_precision=f32",
                     "--set", f"metrics.listen={metrics_listen}", *args]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_ready: bool = True, timeout: float = 60) -> Daemon:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env)
        if wait_ready:
            try:
                self.wait_ready(timeout)
            except BaseException:  # a daemon that never got ready is not left running
                self.proc.kill()
                self.proc.wait(30)
                raise
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        from qvlctl.client import Client

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"qvld exited {self.proc.returncode}:\n{self.log()}")
            try:
                with Client(self.socket, timeout=5) as client:
                    if client.health()["ready"]:
                        return
            except OSError:
                pass
            time.sleep(0.05)  # the polling interval (this loop also watches for an exit)
        raise TimeoutError(f"qvld not ready within {timeout} s:\n{self.log()}")

    def client(self, timeout: float | None = 60) -> Any:
        from qvlctl.client import Client

        return Client(self.socket, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def queue(self) -> tuple[int, int]:
        """(running, waiting) generations, from the status op on a connection of its own."""
        with self.client(timeout=10) as client:
            queue = client.status()["queue"]
        return int(queue["running"]), int(queue["waiting"])

    def wait_queue(self, running: int, waiting: int = 0, timeout: float = 30) -> None:
        """Until exactly ``running`` generations run and ``waiting`` wait."""
        wait_for(lambda: self.queue() == (running, waiting), timeout,
                 f"{running} generation(s) running and {waiting} waiting", detail=self.log)

    def serves_a_new_connection(self) -> bool:
        """Whether a new connection is answered rather than refused busy (the daemon has
        noticed that enough earlier ones closed)."""
        from qvld.errors import Busy

        try:
            with self.client(timeout=10) as client:
                return bool(client.health()["ready"])
        except Busy:
            return False

    def cpu_seconds(self) -> float:
        """User and system CPU time the daemon has used so far."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)

    def qvlctl(self, *args: str, stdin: bytes | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        return run_qvlctl(self.socket, *args, stdin=stdin, timeout=timeout)


def run_qvlctl(socket_path: Path, *args: str, stdin: bytes | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
    """The real qvlctl command line, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "qvlctl.cli", "--socket", str(socket_path), *args],
        input=stdin, capture_output=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    proc = Daemon(tmp_path_factory.mktemp("qvld")).start()
    yield proc
    assert proc.stop() == 0, proc.log()


class HealthProbe:
    """``health`` every ``interval`` s on a connection of its own, in a thread, with each
    answer's latency: what a monitoring probe sees while something else goes on."""

    def __init__(self, daemon: Daemon, interval: float = 0.02) -> None:
        import threading

        self.daemon = daemon
        self.interval = interval
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._probe, daemon=True)

    def _probe(self) -> None:
        with self.daemon.client(timeout=30) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                client.health()
                self.latencies.append(time.perf_counter() - t0)
                self._stop.wait(self.interval)

    def start(self) -> HealthProbe:
        self._thread.start()
        wait_for(lambda: self.latencies or not self._thread.is_alive(), 30,
                 "the probe's first health answer", interval=0.005)
        assert self._thread.is_alive(), "the health probe died"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))]

    def summary(self) -> str:
        return (f"health p50 {self.quantile(0.5) * 1000:.1f} ms, p99 "
                f"{self.quantile(0.99) * 1000:.1f} ms, worst {max(self.latencies) * 1000:.0f}"
                f" ms ({len(self.latencies)} probes)")


def proc_status(pid: int, field: str) -> int:
    """A number field of /proc/PID/status (kB for the memory ones)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class Watch:
    """The daemon's peak RSS above its RSS at the start, and `health` latencies, while
    the block runs."""

    def __init__(self, daemon: Daemon) -> None:
        assert daemon.proc is not None
        self.pid = daemon.proc.pid
        self.probe = HealthProbe(daemon)

    def __enter__(self) -> Watch:
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")  # resets VmHWM to VmRSS
        self.rss0 = proc_status(self.pid, "VmRSS")
        self.probe.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.probe.stop()
        self.peak_mib = (proc_status(self.pid, "VmHWM") - self.rss0) / 1024

    @property
    def worst_s(self) -> float:
        return max(self.probe.latencies)

    def report(self, name: str, answer: str) -> str:
        line = f"{name}: {answer}; peak RSS +{self.peak_mib:.0f} MiB; {self.probe.summary()}"
        print(line)
        return line


# A stdlib-only client run as another user: the other uid needs nothing of this
# checkout. It sends the given frames, then prints "<wall time> <reply hex>" for every
# frame it receives until `finals` non-event replies have come (or the line closes).
OTHER_UID_CLIENT = """
import socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(60)
s.connect(sys.argv[1])
finals = int(sys.argv[2])
for frame in sys.argv[3:]:
    s.sendall(bytes.fromhex(frame))
buf = b""
while finals > 0:
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        chunk = s.recv(65536)
        if not chunk:
            sys.exit(0)
        buf += chunk
    n = 4 + int.from_bytes(buf[:4], "big")
    frame, buf = buf[:n], buf[n:]
    print(time.time(), frame[4:].hex(), flush=True)
    if b"\\xa5event" not in frame:  # the msgpack string "event": a key of events only
        finals -= 1
"""
NOBODY = 65534


def run_as(uid: int, socket_path: Path, messages: list[dict[str, Any]], finals: int = 1,
           extra_groups: list[int] | None = None, wait: bool = True,
           ) -> subprocess.Popen[bytes] | list[tuple[float, dict[str, Any]]]:
    """Send ``messages`` as ``uid``; the replies with their arrival times (or the process)."""
    import shutil

    from qvld import protocol

    python = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
    frames = [protocol.pack(m).hex() for m in messages]
    proc = subprocess.Popen([python, "-c", OTHER_UID_CLIENT, str(socket_path), str(finals),
                             *frames], user=uid, group=uid, extra_groups=extra_groups or [],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                            env={"PATH": "/usr/bin:/bin"})
    if not wait:
        return proc
    return read_replies(proc)


def read_replies(proc: subprocess.Popen[bytes]) -> list[tuple[float, dict[str, Any]]]:
    from qvld import protocol

    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    replies = []
    for line in out.decode().split("\n"):
        if line.strip():
            stamp, payload = line.split()
            replies.append((float(stamp), dict(protocol.unpack(bytes.fromhex(payload)))))
    return replies


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path is private to root)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="qvld-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)
