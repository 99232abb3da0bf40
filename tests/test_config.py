from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from qvld.config import DEPRECATED_KEYS, Config, ConfigError, iter_keys
from qvld.config_loading import instance_source, load_config, with_systemd_cache_dir
from tests.conftest import Daemon, free_port_pair

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "etc" / "qvld" / "qvld.yaml"


def test_every_key_has_a_default() -> None:
    config = Config()
    assert config.engine.infer_requests == 4
    assert config.server.socket == Path("/run/qvld/qvld.sock")
    assert config.server.socket_mode_bits == 0o660
    assert config.metrics.listen == "127.0.0.1:8479"


def test_shipped_file_documents_every_key_with_its_default() -> None:
    assert load_config(SHIPPED) == Config()
    raw = yaml.safe_load(SHIPPED.read_text())
    flat = {f"{section}.{key}" for section, keys in raw.items() for key in keys}
    assert flat == set(iter_keys())
    for line in SHIPPED.read_text().splitlines():
        if ":" in line and line.startswith("  ") and not line.strip().startswith("#"):
            assert "#" in line, f"undocumented: {line}"


def test_overrides_are_typed_like_their_keys() -> None:
    config = load_config(None, [
        "engine.threads=4", "engine.threads=auto", "server.socket_mode=0600",
        "server.allow_uids=[1000, 1001]", "metrics.listen=", "model.cache_dir=",
        "model.warmup=false", "server.read_timeout_s=2.5", "model.path=/models/x",
    ])
    assert config.engine.threads == "auto"
    assert config.server.socket_mode == "0600"
    assert config.server.allow_uids == [1000, 1001]
    assert config.metrics.listen is None
    assert config.model.cache_dir is None
    assert config.model.warmup is False
    assert config.server.read_timeout_s == 2.5
    assert config.model.path == Path("/models/x")


def test_all_errors_are_reported_at_once_with_did_you_mean(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  precison: f32\nengine:\n  threads: many\n  infer_requests: 0\n"
                    "server:\n  socket_mode: 0660\nmetrics:\n  listen: nohost\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["enigne.threads=2", "engine.max_images=x"])
    errors = info.value.errors
    assert len(errors) == 7
    text = "\n".join(errors)
    assert "model.precison: unknown key (did you mean 'precision'?)" in text
    assert "unknown section 'enigne' (did you mean 'engine'?)" in text
    assert "engine.threads:" in text and "'auto'" in text
    assert "engine.infer_requests:" in text
    assert 'server.socket_mode: write the mode as a quoted octal string' in text
    assert "metrics.listen: 'nohost' is not HOST:PORT" in text
    assert "engine.max_images:" in text


@pytest.mark.parametrize("text", ["[1, 2]", "model: [", "model:\n  path: 1\n  path: 2\n"])
def test_unreadable_files_are_config_errors(tmp_path: Path, text: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as exc:
        assert exc.errors
    else:
        assert text.count("path") == 2  # YAML lets a repeated key win; that is valid


def test_cross_key_rules() -> None:
    with pytest.raises(ConfigError, match="default_max_tokens"):
        load_config(None, ["engine.max_new_tokens=512", "engine.default_max_tokens=600"])
    # No cap by default (#47): any default is within it.
    assert load_config(None, ["engine.default_max_tokens=600"]).engine.max_new_tokens == 0


def qvld(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qvld.cli", *args], capture_output=True,
                          text=True, timeout=60, check=False)


def test_qvld_exits_78_with_every_message(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  treads: 2\nlogging:\n  level: loud\n")
    for command in (["check-config"], []):
        out = qvld(*command, "--config", str(path), "--set", "server.max_connections=-1")
        assert out.returncode == 78
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 3, out.stderr
        assert any("did you mean 'threads'" in line for line in lines)
        assert any("logging.level" in line for line in lines)
        assert any("server.max_connections" in line for line in lines)


def test_check_config_validates_the_model_dir(tmp_path: Path, tiny_dir: Path) -> None:
    empty = tmp_path / "c.yaml"
    empty.write_text("")
    ok = qvld("check-config", "--config", str(empty), "--model", str(tiny_dir))
    assert ok.returncode == 0 and "valid" in ok.stdout
    missing = qvld("check-config", "--config", str(empty), "--model", str(tmp_path / "none"))
    assert missing.returncode == 78 and "does not exist" in missing.stderr
    unset = qvld("check-config", "--config", str(empty))
    assert unset.returncode == 78
    assert qvld("--bogus").returncode == 2


def test_a_deprecated_key_still_loads_and_check_config_says_to_remove_it(
        tmp_path: Path, tiny_dir: Path) -> None:
    # engine.batch_invariant did something until #58: a file that sets it is not refused,
    # but the operator hears it is a no-op, whatever its value.
    assert "engine.batch_invariant" not in iter_keys()  # nor in the shipped file
    path = tmp_path / "old.yaml"
    path.write_text("engine:\n  batch_invariant: false\n")
    assert load_config(path).deprecations() == [
        f"engine.batch_invariant is deprecated and has no effect: "
        f"{DEPRECATED_KEYS['engine.batch_invariant']}; remove it"]
    assert load_config(None, ["engine.batch_invariant=true"]).deprecations() != []
    assert Config().deprecations() == []
    out = qvld("check-config", "--config", str(path), "--model", str(tiny_dir))
    assert out.returncode == 0 and "valid" in out.stdout
    assert "qvld: warning: engine.batch_invariant is deprecated" in out.stderr


def test_check_config_says_what_pictures_and_clips_are_processed_with_and_from_where(
        tmp_path: Path, tiny_dir: Path) -> None:
    # #48: a directory without the video processor's config was served with
    # transformers' defaults, silently.
    empty = tmp_path / "c.yaml"
    empty.write_text("")
    plain = qvld("check-config", "--config", str(empty), "--model", str(tiny_dir))
    assert plain.returncode == 0
    rows = {line.split()[0]: line for line in plain.stdout.splitlines()[2:]}
    assert "preprocessor_config.json" in rows["image.max_pixels"]
    assert "config.json" in rows["vision.spatial_merge_size"]
    assert "transformers' default (no video_preprocessor_config.json)" in rows["video.fps"]
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model, ignore=shutil.ignore_patterns("onnx_*", "reference*"))
    (model / "video_preprocessor_config.json").write_text(json.dumps(
        {"fps": 1.5, "max_frames": 24, "size": {"shortest_edge": 4096,
                                                 "longest_edge": 65536}}))
    own = qvld("check-config", "--config", str(empty), "--model", str(model))
    rows = {line.split()[0]: line for line in own.stdout.splitlines()[2:]}
    assert rows["video.fps"].split()[1] == "1.5" and "from video_preprocessor_config.json" \
        in rows["video.fps"]
    assert rows["video.max_pixels"].split()[1] == "65536"
    assert "not in video_preprocessor_config.json" in rows["video.min_frames"]


def test_systemd_cache_directory_is_the_default_cache_dir(tmp_path: Path) -> None:
    config = Config()
    assert with_systemd_cache_dir(config, {}).model.cache_dir is None
    chosen = with_systemd_cache_dir(config, {"CACHE_DIRECTORY": "/var/cache/qvld:/x"})
    assert chosen.model.cache_dir == Path("/var/cache/qvld")
    own = Config.model_validate({"model": {"cache_dir": str(tmp_path)}})
    assert with_systemd_cache_dir(own, {"CACHE_DIRECTORY": "/var/cache/qvld"}) is own


def test_the_daemon_compiles_into_systemds_cache_directory(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    daemon = Daemon(tmp_path, env={"CACHE_DIRECTORY": str(cache)}).start()
    try:
        with daemon.client() as client:
            checks = {c["id"]: c for c in client.call("preflight")["checks"]}
        assert checks["cache_dir"]["status"] == "ok", checks["cache_dir"]
        assert any(cache.iterdir()), "OpenVINO wrote no compiled model into the cache"
    finally:
        assert daemon.stop() == 0


# -- instances of the template units (qvld@NAME) --------------------------------------------


def test_an_instance_with_a_file_of_its_own_reads_that_file(tmp_path: Path) -> None:
    shared = tmp_path / "qvld.yaml"
    shared.write_text("engine:\n  threads: 2\n")
    (tmp_path / "edge-a.yaml").write_text("http:\n  listen: 127.0.0.1:9999\n")
    path, overrides = instance_source(shared, ["engine.threads=1"], "edge-a")
    assert path == tmp_path / "edge-a.yaml" and overrides == ["engine.threads=1"]
    assert load_config(path, overrides).http.listen == "127.0.0.1:9999"


def test_a_node_numbered_instance_is_the_shared_file_on_that_node(tmp_path: Path) -> None:
    shared = tmp_path / "qvld.yaml"
    shared.write_text("server:\n  socket: /run/qvld/qvld.sock\nmetrics:\n  listen: "
                      "127.0.0.1:8479\nhttp:\n  listen: 0.0.0.0:8100\n"
                      "model:\n  cache_dir: /var/cache/qvld\n")
    path, overrides = instance_source(shared, [], "3")
    config = load_config(path, overrides)
    assert path == shared
    assert config.tuning.numa_node == 3
    assert config.model.cache_dir == Path("/var/cache/qvld/3")
    assert config.server.socket == Path("/run/qvld/qvld-3.sock")
    assert config.http.listen == "0.0.0.0:8103" and config.metrics.listen == "127.0.0.1:8482"
    # no HTTP port in the shared file: qvld-http.socket's 8090, moved up; metrics off stays off
    shared.write_text("metrics:\n  listen: ~\n")
    config = load_config(*instance_source(shared, [], "1"),
                         environ={"CACHE_DIRECTORY": "/var/cache/qvld/1"})
    assert config.http.listen == "127.0.0.1:8091" and config.metrics.listen is None
    assert config.model.cache_dir == Path("/var/cache/qvld/1")  # systemd's


@pytest.mark.parametrize("name, error", [
    ("edge-b", "no {dir}/edge-b.yaml, and edge-b is not a NUMA node number"),
    ("../etc", "a name is 1-64 of [A-Za-z0-9_-]"),
    ("", "a name is 1-64 of [A-Za-z0-9_-]")])
def test_an_instance_that_names_nothing_is_a_config_error(tmp_path: Path, name: str,
                                                          error: str) -> None:
    with pytest.raises(ConfigError) as refused:
        instance_source(tmp_path / "qvld.yaml", [], name)
    assert error.format(dir=tmp_path) in refused.value.errors[0]


def test_qvld_runs_as_an_instance(tmp_path: Path) -> None:
    """The real daemon as `qvld --instance 1`: its own socket and moved HTTP port."""
    base = free_port_pair()
    daemon = Daemon(tmp_path, socket_path=tmp_path / "qvld-1.sock", config_text=(
        f"server:\n  socket: {tmp_path}/qvld.sock\n"
        f"http:\n  listen: 127.0.0.1:{base}\n"))  # its --config is tmp_path/qvld.yaml
    shared = tmp_path / "qvld.yaml"
    daemon.argv = [a for a in daemon.argv if a not in ("--socket", str(daemon.socket))]
    daemon.argv += ["--instance", "1"]
    daemon.start()
    try:
        with daemon.client() as client:
            config = client.config()
        assert config["tuning"]["numa_node"] == 1
        assert config["http"]["listen"] == f"127.0.0.1:{base + 1}"
        with urllib.request.urlopen(f"http://127.0.0.1:{base + 1}/health", timeout=10) as reply:
            assert json.load(reply)["ready"] is True
    finally:
        assert daemon.stop() == 0
    out = subprocess.run([sys.executable, "-m", "qvld.cli", "--config", str(shared),
                          "--instance", "edge", "check-config"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 78 and "edge is not a NUMA node number" in out.stderr
