"""`qvlctl model convert`'s frame around an exporter: progress while it runs, the result
moved into place only once it answers; `export-onnx` into a directory holding the IR adds
the graphs only when they are the same checkpoint's and the directory then serves. The
exporters themselves (optimum-intel, the ONNX export) run in the reference tier
(tests/reference/test_model_convert.py)."""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from qvld.config import Config
from qvld.engine import Engine
from qvld.engine.model.model_dir import SUBMODELS
from qvld.errors import ModelInvalid
from qvld.modeltools.convert import ExportProgress, add_beside_ir, write_model
from tests.conftest import TINY, outdate_onnx_graphs, wait_for


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


# -- `qvlctl model export-onnx` into a directory that holds the IR ----------------------

def ir_only(tmp_path: Path) -> Path:
    model = tmp_path / "models" / "tiny"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("onnx_*", "images"))
    return model


def onnx_export_of(checkpoint: Path, tamper: Callable[[Path], None] | None = None
                   ) -> Callable[[Path, Path], None]:
    """An exporter that writes the committed fixture's ONNX graphs (the same checkpoint
    as its IR) and side files, optionally changed by ``tamper``."""
    def export(source: Path, out: Path) -> None:
        for path in checkpoint.iterdir():
            if path.is_file() and not path.name.startswith("openvino_"):
                shutil.copy(path, out / path.name)
        if tamper is not None:
            tamper(out)
    return export


def state(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_graphs_are_added_beside_the_ir_and_the_split_serves(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = ir_only(tmp_path)
    before = state(model)
    assert add_beside_ir(str(TINY), model, "to ONNX", onnx_export_of(TINY)) == 0
    after = state(model)
    added = sorted(set(after) - set(before))
    assert added == sorted(f"onnx_{sub}.onnx" for sub in SUBMODELS)
    assert all(after[name] == before[name] for name in before)  # the IR's files untouched
    assert list((tmp_path / "models").iterdir()) == [model]  # no partial directory left
    err = capsys.readouterr().err
    assert "serves with images and prompts on ONNX Runtime" in err
    # The fixture's graphs are fp32, which auto leaves alone: the message says how.
    assert "set model.prompt_backend: onnxruntime" in err
    # At f32 with an f32 KV cache: ONNX Runtime's rows go into an f16 or f32 one (where
    # the CPU has AVX-512, auto is bf16 or u8, and prompts then stay on OpenVINO).
    engine = Engine(Config.model_validate({"model": {
        "path": str(model), "prompt_backend": "onnxruntime", "precision": "f32",
        "kv_cache_precision": "f32"}}))
    assert engine.prompt_runtime == "onnxruntime"


def test_a_directory_with_graphs_already_is_left_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "both"
    shutil.copytree(TINY, model)
    before = state(model)
    ran: list[Path] = []
    assert add_beside_ir(str(TINY), model, "to ONNX", lambda s, o: ran.append(o)) == 2
    assert "already holds ONNX graphs" in capsys.readouterr().err
    assert not ran and state(model) == before


def test_graphs_an_older_qvld_exported_are_replaced_and_put_back_if_the_new_do_not_serve(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qvld.engine.model.model_dir import onnx_outdated

    model = tmp_path / "models" / "both"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("images"))
    outdate_onnx_graphs(model)
    why = onnx_outdated(model)
    assert why is not None and f"export-onnx CHECKPOINT {model} --weights int8` replaces" in why
    before = state(model)

    def broken(out: Path) -> None:
        (out / "onnx_language_model.onnx").write_bytes(b"not a graph")

    with pytest.raises(ModelInvalid, match=r"onnx_language_model\.onnx cannot be loaded"):
        add_beside_ir(str(TINY), model, "to ONNX", onnx_export_of(TINY, broken))
    assert state(model) == before and list((tmp_path / "models").iterdir()) == [model]
    assert add_beside_ir(str(TINY), model, "to ONNX", onnx_export_of(TINY)) == 0
    assert "replacing the graphs an older qvld exported" in capsys.readouterr().err
    assert onnx_outdated(model) is None and state(model) == state(TINY) | {
        name: data for name, data in before.items() if not name.startswith("onnx_")}
    assert list((tmp_path / "models").iterdir()) == [model]
    # An ONNX-only directory is exported anew beside it.
    alone = tmp_path / "onnx-only"
    shutil.copytree(TINY, alone, ignore=shutil.ignore_patterns("openvino_*", "images"))
    outdate_onnx_graphs(alone)
    assert "export-onnx CHECKPOINT NEW_DIR --weights int8` exports" in str(onnx_outdated(alone))


def test_graphs_of_another_checkpoint_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np
    import onnx
    from onnx import numpy_helper

    def other_weights(out: Path) -> None:
        # Same dimensions, other (random) embedding weights: another training run.
        path = out / "onnx_text_embeddings_model.onnx"
        proto = onnx.load(str(path))
        for i, tensor in enumerate(proto.graph.initializer):
            table = numpy_helper.to_array(tensor)
            if table.ndim == 2:
                other = np.random.default_rng(0).standard_normal(table.shape).astype(table.dtype)
                proto.graph.initializer[i].CopyFrom(numpy_helper.from_array(other, tensor.name))
        onnx.save(proto, str(path))

    model = ir_only(tmp_path)
    before = state(model)
    assert add_beside_ir(str(TINY), model, "to ONNX", onnx_export_of(TINY, other_weights)) == 2
    assert "the text embeddings differ" in capsys.readouterr().err
    assert state(model) == before and list((tmp_path / "models").iterdir()) == [model]

    def deeper(out: Path) -> None:  # another model's config beside the graphs
        config = json.loads((out / "config.json").read_text())
        config["text_config"]["num_hidden_layers"] += 1
        (out / "config.json").write_text(json.dumps(config))

    assert add_beside_ir(str(TINY), model, "to ONNX", onnx_export_of(TINY, deeper)) == 2
    assert "dimensions differ (num_layers" in capsys.readouterr().err
    assert state(model) == before


def test_graphs_that_do_not_serve_are_taken_out_again(tmp_path: Path) -> None:
    def broken(out: Path) -> None:
        (out / "onnx_language_model.onnx").write_bytes(b"not a graph")

    model = ir_only(tmp_path)
    before = state(model)
    with pytest.raises(ModelInvalid, match=r"onnx_language_model\.onnx cannot be loaded"):
        add_beside_ir(str(TINY), model, "to ONNX", onnx_export_of(TINY, broken))
    assert state(model) == before and list((tmp_path / "models").iterdir()) == [model]


def test_export_onnx_adds_beside_an_ir_and_writes_a_new_directory_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qvld.modeltools import onnx_export

    calls: list[str] = []
    monkeypatch.setattr(onnx_export, "add_beside_ir", lambda *a: calls.append("beside") or 0)
    monkeypatch.setattr(onnx_export, "write_model", lambda *a, **k: calls.append("new") or 0)
    onnx_export.export_onnx(str(TINY), ir_only(tmp_path), "int8")
    onnx_export.export_onnx(str(TINY), tmp_path / "fresh", "int8")
    assert calls == ["beside", "new"]


def test_conversion_keeps_the_video_processors_settings(tmp_path: Path) -> None:
    """#48: ``video_preprocessor_config.json`` was left behind, so a converted model's
    clips were sampled with transformers' class defaults (a 640x360 clip encoded at
    416x224 instead of 640x352): every processor file the engine reads is copied."""
    from qvld.modeltools.convert import copy_side_files

    src, dst = tmp_path / "checkpoint", tmp_path / "ir"
    src.mkdir()
    dst.mkdir()
    video = {"min_pixels": 4096, "max_pixels": 25165824, "fps": 2}
    (src / "video_preprocessor_config.json").write_text(json.dumps(video))
    (src / "preprocessor_config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    (dst / "preprocessor_config.json").write_text('{"written": "by the exporter"}')
    assert copy_side_files(src, dst) == ["video_preprocessor_config.json"]
    assert json.loads((dst / "video_preprocessor_config.json").read_text()) == video
    assert "exporter" in (dst / "preprocessor_config.json").read_text()  # not replaced
    assert not (dst / "model.safetensors").exists()
