"""`qvlctl model convert`'s frame around an exporter: progress while it runs, the result
moved into place only once it answers. The exporters themselves (optimum-intel, the ONNX
export) run in the reference tier (tests/reference/test_model_convert.py)."""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path

import pytest

from qvld.engine.model_dir import SUBMODELS
from qvld.modeltools.convert import ExportProgress, write_model
from tests.conftest import TINY, wait_for


def graphs_of(submodel: str) -> list[Path]:
    return [TINY / f"openvino_{submodel}.xml", TINY / f"openvino_{submodel}.bin"]


def test_progress_in_a_log_is_a_line_per_graph(tmp_path: Path) -> None:
    (tmp_path / "deep" / "tmpabc").mkdir(parents=True)  # an exporter's temporary directory
    stream = io.StringIO()
    with ExportProgress(tmp_path, stream=stream, interval_s=0.02, heartbeat_s=3600) as progress:
        shutil.copy(TINY / "openvino_language_model.xml", tmp_path / "deep" / "tmpabc")
        wait_for(lambda: progress.seen == {"language_model"}, timeout=10)
        shutil.copy(TINY / "onnx_text_embeddings_model.onnx",
                    tmp_path / "onnx_text_embeddings_model.int8.onnx")
        wait_for(lambda: len(progress.seen) == 2, timeout=10)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("qvlctl model: language_model written (0:0")
    assert f"1 of {len(SUBMODELS)} graphs written" in lines[0]
    assert lines[1].startswith("qvlctl model: text_embeddings_model written")
    assert f"2 of {len(SUBMODELS)} graphs written" in lines[1] and "MiB on disk" in lines[1]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_long_step_gets_a_heartbeat_line(tmp_path: Path) -> None:
    stream = io.StringIO()
    with ExportProgress(tmp_path, stream=stream, interval_s=0.02, heartbeat_s=0.05):
        wait_for(lambda: stream.getvalue().count("\n") >= 2, timeout=10)
    assert stream.getvalue().startswith(
        "qvlctl model: still exporting (0:00 elapsed, loading and tracing the checkpoint, ")


def test_progress_on_a_terminal_is_one_line_redrawn(tmp_path: Path) -> None:
    stream = FakeTerminal()
    with ExportProgress(tmp_path, stream=stream, interval_s=0.02):
        wait_for(lambda: stream.getvalue().count("\r") >= 2, timeout=10)
    shown = stream.getvalue()
    assert "\n" not in shown
    assert "\r\x1b[Kqvlctl model: 0:00 elapsed, loading and tracing the checkpoint" in shown
    assert shown.endswith("\r\x1b[K")  # cleared for the lines that follow


def test_write_model_watches_the_exporters_temporary_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    used: list[Path] = []

    def export(source: Path, out: Path) -> None:
        # as optimum does: export into a TemporaryDirectory, then save into `out`
        with tempfile.TemporaryDirectory() as scratch:
            used.append(Path(scratch))
            for submodel in SUBMODELS:
                for path in graphs_of(submodel):
                    shutil.copy(path, Path(scratch) / path.name)
            wait_for(lambda: f"{len(SUBMODELS)} of {len(SUBMODELS)} graphs" in
                     capsys.readouterr().err, timeout=10)
            shutil.copytree(source, out, dirs_exist_ok=True)

    dst = tmp_path / "models" / "tiny"
    assert write_model(str(TINY), dst, "as a copy", export) == 0
    assert used and used[0].parent.parent.name.startswith(".tiny.partial-")
    assert (dst / "openvino_language_model.xml").is_file() and not (dst / ".tmp").exists()
    assert list((tmp_path / "models").iterdir()) == [dst]
    assert tempfile.gettempdir() != str(used[0].parent)  # put back


def test_a_failed_export_leaves_nothing_and_restores_tempdir(tmp_path: Path) -> None:
    def export(source: Path, out: Path) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            shutil.copy(TINY / "openvino_language_model.xml", scratch)
            raise RuntimeError("tracing failed")

    before = tempfile.gettempdir()
    with pytest.raises(RuntimeError, match="tracing failed"):
        write_model(str(TINY), tmp_path / "out", "as a copy", export)
    assert list(tmp_path.iterdir()) == [] and tempfile.gettempdir() == before
