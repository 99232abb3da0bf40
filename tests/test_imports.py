"""Dependency direction: the run-time stack never pulls in torch or transformers."""

from __future__ import annotations

import subprocess
import sys


def modules_after(statement: str) -> set[str]:
    code = f"{statement}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return set(out.split())


def test_engine_runs_without_torch_or_transformers() -> None:
    loaded = modules_after("import qvld.engine")
    assert "openvino" in loaded
    assert not {"torch", "transformers", "optimum"} & loaded


def test_qvlctl_never_imports_the_engine() -> None:
    loaded = modules_after("import qvlctl.cli")
    assert not {"openvino", "torch", "transformers", "numpy", "PIL", "qvld.engine"} & loaded
