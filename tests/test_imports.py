"""Dependency direction: the run-time stack never pulls in torch or transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return set(out.split())


def test_engine_runs_without_torch_or_transformers() -> None:
    loaded = modules_after("import qvld.engine")
    assert not {"torch", "transformers", "optimum"} & loaded
    # A runtime loads only when model.backend selects it.
    assert not {"openvino", "onnxruntime"} & loaded


def test_each_backend_loads_only_its_runtime() -> None:
    from tests.conftest import TINY

    for backend, runtime, other in (("openvino", "openvino", "onnxruntime"),
                                    ("onnxruntime", "onnxruntime", "openvino")):
        loaded = modules_after(
            "from pathlib import Path; from qvld.config import Config, ModelConfig; "
            "from qvld.engine import Engine; "
            f"Engine(Config(model=ModelConfig(path=Path({str(TINY)!r}), backend={backend!r})))")
        assert runtime in loaded and other not in loaded, backend
        assert not {"torch", "transformers"} & loaded


def test_model_tools_import_torch_only_when_they_run() -> None:
    loaded = modules_after("import qvld.modeltools.convert, qvld.modeltools.onnx_export")
    assert not {"torch", "transformers", "optimum", "onnx", "onnxruntime", "openvino"} & loaded


def modeltools_in(loaded: set[str]) -> set[str]:
    return {m for m in loaded if m == "qvld.modeltools" or m.startswith("qvld.modeltools.")}


def test_qvlctl_never_imports_the_engine() -> None:
    loaded = modules_after("import qvlctl.cli")
    assert not {"openvino", "onnxruntime", "onnx", "torch", "transformers", "numpy", "PIL",
                "qvld.engine"} & loaded
    # The model tooling is qvld's, not the client's: loaded only by a `model` command.
    assert not modeltools_in(loaded)


def test_qvlctl_model_loads_the_model_tools_when_it_runs(tmp_path: Path) -> None:
    missing = tmp_path / "none"
    loaded = modules_after(
        f"import qvlctl.cli; qvlctl.cli.main(['model', 'info', {str(missing)!r}])")
    assert "qvld.modeltools.convert" in modeltools_in(loaded)
    assert not {"torch", "transformers"} & loaded
