"""The runtime stays behind the engine: with `model.backend: onnxruntime` the daemon never
loads OpenVINO, not at start, not while serving, not for status, metrics or preflight;
what it reports names the runtime it really runs."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import TINY, Daemon


def mapped_libraries(pid: int) -> set[str]:
    names = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
        if ".so" in path:
            names.add(Path(path).name)
    return names


def test_the_onnx_backend_never_loads_openvino(tmp_path: Path) -> None:
    model = tmp_path / "onnx-only"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("openvino_*", "images"))
    daemon = Daemon(tmp_path, model=model, args=["--set", "model.backend=onnxruntime"]).start()
    try:
        with daemon.client() as client:
            result = client.generate({"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 3})
            assert len(result["token_ids"]) == 3
            status = client.status()
            metrics = client.metrics()
            preflight = client.preflight()
        assert daemon.proc is not None
        libraries = mapped_libraries(daemon.proc.pid)
    finally:
        assert daemon.stop() == 0
    assert any(name.startswith("libonnxruntime") for name in libraries), libraries
    assert not [name for name in libraries if "openvino" in name]
    runtime = status["model"]["runtime"]
    assert runtime["name"] == "onnxruntime" and runtime["version"]
    assert 'backend="onnxruntime"' in metrics and "openvino" not in metrics.split(
        "qvld_build_info{")[1].split("}")[0]
    python = next(c for c in preflight["checks"] if c["id"] == "python")
    assert "onnxruntime" in python["found"] and "openvino" not in python["found"]


def test_the_openvino_backend_reports_its_runtime(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path).start()
    try:
        with daemon.client() as client:
            runtime = client.status()["model"]["runtime"]
            metrics = client.metrics()
    finally:
        assert daemon.stop() == 0
    import openvino

    assert runtime["name"] == "openvino"
    assert runtime["version"] == str(openvino.__version__).split("-")[0]
    assert f'runtime_version="{runtime["version"]}"' in metrics
