"""A configuration `qvld check-config` accepts is one the runtime accepts: every value
that would fail later (a C int overflow, NaN, an unresolvable host, a CPU list that
cannot be parsed, a crash in OpenVINO) is refused at load, with exit 78. And a native
crash that still happens leaves a line on stderr (the journal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qvld.config import ConfigError, iter_keys
from qvld.config_loading import _field, load_config

ROOT = Path(__file__).resolve().parents[1]


def refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    assert len(info.value.errors) == len(overrides), info.value.errors
    return "\n".join(info.value.errors)


def float_keys() -> list[str]:
    return [key for key in iter_keys() if _field(key.split("."))[0] is float]


def test_there_are_float_keys_to_check() -> None:
    assert {"server.read_timeout_s", "engine.session_ttl_s"} <= set(float_keys())


@pytest.mark.parametrize("key", float_keys())
@pytest.mark.parametrize("value", [".nan", "nan", ".inf", "-.inf", "1e400"])
def test_no_float_key_takes_nan_or_infinity(key: str, value: str) -> None:
    # NaN fails every comparison (a NaN timeout never passes); inf overflows the clocks.
    assert f"{key}: Input should be a finite number" in refused(f"{key}={value}")


@pytest.mark.parametrize(("override", "expected"), [
    # setsockopt(SO_SNDBUF) takes a C int: 2**31 passed, then every connection failed.
    ("server.send_buffer_bytes=2147483648", "server.send_buffer_bytes: Input should be less "
                                            "than or equal to 2147483647"),
    ("server.max_frame_bytes=4294967296", "server.max_frame_bytes: Input should be less than"),
    # OpenVINO refuses INFERENCE_NUM_THREADS >= 2**31 at compile time.
    ("engine.threads=2147483648", "engine.threads: Input should be less than or equal to 1024"),
    ("engine.threads=0", "engine.threads: Input should be greater than or equal to 1"),
    ("model.dynamic_quantization=-1", "model.dynamic_quantization: Input should be greater"),
    ("model.dynamic_quantization=18446744073709551616", "model.dynamic_quantization: Input "
                                                        "should be less than or equal to 65536"),
    ("tuning.nofile=18446744073709551616", "tuning.nofile: Input should be less than"),
    ("tuning.numa_node=-1", "tuning.numa_node: Input should be greater than or equal to 0"),
    ("tuning.numa_node=4096", "tuning.numa_node: Input should be less than or equal to 1023"),
    ("server.allow_uids=[-1]", "server.allow_uids: Input should be greater than or equal to 0"),
    ("server.allow_uids=[4294967295]", "server.allow_uids: Input should be less than"),
    ("server.read_timeout_s=1e12", "server.read_timeout_s: Input should be less than"),
    # tuning parses the list at start-up: a typo raised there, a huge range ate memory.
    ("tuning.pin_cpus=0-3,x", "tuning.pin_cpus: '0-3,x' is not 'auto' or a CPU list"),
    ("tuning.pin_cpus=0-999999999", "tuning.pin_cpus: '0-999999999': CPUs are 0..8191"),
    ("tuning.pin_cpus=5-2", "tuning.pin_cpus: '5-2': CPUs are 0..8191, low-high"),
    ("server.socket=/" + "s" * 120, "server.socket: a Unix socket path is at most 107 bytes"),
    # The exporter binds HOST:PORT; a host that cannot be bound made the daemon exit 1.
    ("metrics.listen=256.1.1.1:9000", "metrics.listen: '256.1.1.1' is not an IPv4 address"),
    ("metrics.listen=no-such-host.invalid:9000",
     "metrics.listen: host 'no-such-host.invalid' does not resolve"),
    ("metrics.listen=::1:8479", "metrics.listen: write an IPv6 address in brackets"),
    ("metrics.listen=[127.0.0.1]:8479", "metrics.listen: [127.0.0.1] is not an IPv6 address"),
    ("metrics.listen=127.0.0.1:0", "metrics.listen: '127.0.0.1:0' is not HOST:PORT"),
    ("metrics.listen=127.0.0.1:65536", "metrics.listen: '127.0.0.1:65536' is not HOST:PORT"),
    ("metrics.listen=127.0.0.1:٩٤٦٤", "is not HOST:PORT"),  # int() reads Arabic digits
])
def test_values_the_runtime_refuses_are_config_errors(override: str, expected: str) -> None:
    assert expected in refused(override)


@pytest.mark.parametrize(("override", "key", "value"), [
    ("server.send_buffer_bytes=2147483647", "server.send_buffer_bytes", 2**31 - 1),
    ("engine.threads=1024", "engine.threads", 1024),
    ("tuning.pin_cpus=0-3,6,", "tuning.pin_cpus", "0-3,6,"),
    ("tuning.pin_cpus=8191", "tuning.pin_cpus", "8191"),
    ("metrics.listen=[::1]:8479", "metrics.listen", "[::1]:8479"),
    ("metrics.listen=localhost:8479", "metrics.listen", "localhost:8479"),
    ("metrics.listen=:8479", "metrics.listen", ":8479"),
    ("metrics.listen=0.0.0.0:1", "metrics.listen", "0.0.0.0:1"),
    ("model.dynamic_quantization=0", "model.dynamic_quantization", 0),
    ("engine.streams=1", "engine.streams", 1),
])
def test_values_within_the_limits_are_kept(override: str, key: str, value: Any) -> None:
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, [override]), section), name) == value


def test_a_nul_byte_in_a_path_or_name_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text('model:\n  path: "/m\\0x"\n  cache_dir: "/c\\0x"\nserver:\n'
                    '  socket: "/s\\0x"\n  allow_groups: ["q\\0"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert len(info.value.errors) == 4
    assert all("must not contain a NUL byte" in line for line in info.value.errors)


def test_more_than_one_stream_is_refused_with_the_remedy() -> None:
    # engine.streams: 2 died of SIGFPE inside OpenVINO's CPU plugin, nothing logged.
    for value in ("2", "0", "8"):
        text = refused(f"engine.streams={value}")
        assert text.startswith("engine.streams: must be 1")
        assert "remedy: remove engine.streams" in text and "engine.max_sequences" in text


def qvld(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qvld.cli", *args], capture_output=True,
                          text=True, timeout=60, check=False, cwd=ROOT)


@pytest.mark.parametrize(("override", "commands"), [
    ("engine.streams=2", [["check-config"]]),
    ("server.send_buffer_bytes=2147483648", [["check-config"]]),
    ("metrics.listen=256.1.1.1:9000", [["check-config"], []]),
    ("metrics.listen=no-such-host.invalid:9000", [["check-config"], []]),
    ("server.read_timeout_s=.nan", [["check-config"], []]),
])
def test_qvld_exits_78_before_starting(tmp_path: Path, tiny_dir: Path, override: str,
                                       commands: list[list[str]]) -> None:
    empty = tmp_path / "c.yaml"
    empty.write_text("")
    key = override.split("=")[0]
    for command in commands:
        out = qvld(*command, "--config", str(empty), "--model", str(tiny_dir),
                   "--socket", str(tmp_path / "s"), "--set", override)
        assert out.returncode == 78, out.stderr
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith(f"qvld: config: {key}: ")


CRASH = """
import faulthandler, os, signal, sys
from qvld import cli
cli.main(["check-config", "--config", sys.argv[1]])  # the entry point's own set-up
how = sys.argv[2]
if how == "sigsegv":
    faulthandler._sigsegv()  # a real invalid memory access, as in a native library
os.kill(os.getpid(), getattr(signal, how))
"""


@pytest.mark.parametrize("how", ["SIGFPE", "SIGSEGV", "SIGABRT", "SIGBUS", "sigsegv"])
def test_a_native_crash_leaves_a_line_on_stderr(tmp_path: Path, how: str) -> None:
    empty = tmp_path / "c.yaml"
    empty.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    out = subprocess.run([sys.executable, "-c", CRASH, str(empty), how], capture_output=True,
                         text=True, timeout=60, check=False, cwd=ROOT, env=env)
    number = signal.SIGSEGV if how == "sigsegv" else getattr(signal, how)
    assert out.returncode == -number, out.stderr
    assert "Fatal Python error" in out.stderr, out.stderr
    assert "most recent call first" in out.stderr  # where it happened
