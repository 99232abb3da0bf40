"""`qvlctl model convert|info` on a real (tiny) checkpoint, every weight format.

Needs the `convert` extra: part of the reference tier (`make test-reference`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qvld.engine.model.model_dir import SUBMODELS
from tests.conftest import Daemon

pytestmark = [pytest.mark.reference, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"fp32": {"f32"}, "fp16": {"f16"}, "int8": {"u8", "i8"}, "int4": {"u4", "i4"}}
LAYOUT = {"fp32": "float", "fp16": "float", "int8": "int8 sym per channel",
          "int4": "int4 sym per channel"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset as a Hugging Face checkpoint directory."""
    out = tmp_path_factory.mktemp("checkpoint") / "tiny"
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
            "import make_test_model as m; m.save_hf('tiny', Path(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", code, str(ROOT / "tools"), str(out)], check=True,
                   capture_output=True)
    return out


def qvlctl(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qvlctl.cli", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("weights", ["fp32", "fp16", "int8", "int4"])
def test_convert_each_weight_format_and_serve_it(checkpoint: Path, tmp_path: Path,
                                                 weights: str) -> None:
    dst = tmp_path / f"tiny-{weights}"
    out = qvlctl("model", "convert", str(checkpoint), str(dst), "--weights", weights)
    assert out.returncode == 0, out.stderr
    assert "serves" in out.stderr
    # progress through optimum's own temporary directory, a line per graph
    assert out.stderr.count(" written (") == len(SUBMODELS), out.stderr
    assert f"{len(SUBMODELS)} of {len(SUBMODELS)} graphs written" in out.stderr
    assert not list(tmp_path.glob(".*partial*"))
    info = json.loads(qvlctl("model", "info", str(dst), "--json").stdout)
    assert info["loadable"] and info["model_type"] == "qwen3_vl"
    language = info["weights"]["language_model"]
    dominant = max(language, key=language.get)
    assert dominant in EXPECTED[weights], language
    # qvld's recipe: symmetric, one scale per output channel (int4: every layer).
    assert info["language_model_layout"] == LAYOUT[weights]
    assert info["text"]["hidden_size"] == 128 and info["chat_template"]
    daemon = Daemon(tmp_path, model=dst, args=["--set", "model.backend=openvino"]).start()
    try:
        with daemon.client() as client:
            result = client.generate({"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 4, "temperature": 0})
        assert len(result["token_ids"]) == 4
    finally:
        assert daemon.stop() == 0
    if weights == "fp32":  # the f32 export is the same model as the committed fixture
        verify = qvlctl("model", "verify", str(dst), "--reference",
                        str(ROOT / "tests/fixtures/models/tiny/reference.json"), "--json")
        assert json.loads(verify.stdout)["token_agreement"] == 1.0, verify.stdout


def test_an_interrupted_conversion_leaves_nothing(checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "never"
    proc = subprocess.Popen([sys.executable, "-m", "qvlctl.cli", "model", "convert",
                             str(checkpoint), str(dst), "--weights", "int8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # Ctrl-C as a terminal delivers it (a background test run
                            # hands its children SIGINT ignored).
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".never.partial-*")):  # the export has started
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert not dst.exists()
    assert list(tmp_path.iterdir()) == []


def test_info_refuses_what_is_not_an_export(tmp_path: Path, checkpoint: Path) -> None:
    out = qvlctl("model", "info", str(checkpoint))
    assert out.returncode == 4
    assert "lacks openvino_language_model.xml" in out.stdout


def test_convert_other_recipes_on_request(checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "tiny-int4-asym-g16"
    out = qvlctl("model", "convert", str(checkpoint), str(dst), "--weights", "int4",
                 "--asym", "--group-size", "16", "--lm-head-int8")
    assert out.returncode == 0, out.stderr
    assert "int4 asym group 16, ratio 1, lm_head int8" in out.stderr
    info = json.loads(qvlctl("model", "info", str(dst), "--json").stdout)
    assert info["loadable"] and info["language_model_layout"] == "int4 asym group 16"


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_export_onnx_and_serve_it(checkpoint: Path, tmp_path: Path, weights: str) -> None:
    dst = tmp_path / f"tiny-onnx-{weights}"
    out = qvlctl("model", "export-onnx", str(checkpoint), str(dst), "--weights", weights)
    assert out.returncode == 0, out.stderr
    assert "serves with model.backend: onnxruntime" in out.stderr
    assert not list(tmp_path.glob(".*partial*"))
    graphs = sorted(p.name for p in dst.glob("onnx_*"))
    assert graphs == sorted(f"onnx_{sub}.onnx" for sub in SUBMODELS)
    import onnx

    ops = {node.op_type for node in onnx.load(str(dst / "onnx_language_model.onnx")).graph.node}
    # int8: each MatMul's activations quantised per row (a scale of each token's own)
    assert ("MatMulIntegerToFloat" in ops) == (weights == "int8")
    assert ("DynamicQuantizeLinear" in ops) is False
    daemon = Daemon(tmp_path, model=dst, args=["--set", "model.backend=onnxruntime"]).start()
    try:
        with daemon.client() as client:
            assert client.status()["model"]["runtime"]["WEIGHTS"] == weights
            result = client.generate({"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 4, "temperature": 0})
        assert len(result["token_ids"]) == 4
    finally:
        assert daemon.stop() == 0
    if weights == "fp32":  # the same model as the committed fixture: exact
        verify = qvlctl("model", "verify", str(dst), "--backend", "onnxruntime", "--reference",
                        str(ROOT / "tests/fixtures/models/tiny/reference.json"), "--json")
        assert json.loads(verify.stdout)["token_agreement"] == 1.0, verify.stdout


@pytest.mark.parametrize("ir_weights", ["int8", "int4"])
def test_export_onnx_into_the_ir_directory_and_serve_the_split(checkpoint: Path,
                                                                tmp_path: Path,
                                                                ir_weights: str) -> None:
    # The README's route to the IR plus int8 graphs: convert, then export-onnx into the
    # same directory. model.backend auto then runs all on ONNX Runtime on a CPU without
    # VNNI or AMX and says so; with OpenVINO decoding (set here) prompt_backend auto
    # takes the graphs. An int4 IR (its embedding table in 4 bits too) is still
    # recognised as the same checkpoint.
    from qvld.engine.model.model_dir import choose_backend, cpu_flags
    dst = tmp_path / f"tiny-{ir_weights}"
    assert qvlctl("model", "convert", str(checkpoint), str(dst), "--weights",
                  ir_weights).returncode == 0
    ir_files = {p.name: p.stat().st_mtime_ns for p in dst.iterdir()}
    out = qvlctl("model", "export-onnx", str(checkpoint), str(dst), "--weights", "int8")
    assert out.returncode == 0, out.stderr
    assert "serves with images and prompts on ONNX Runtime" in out.stderr
    runtime, why = choose_backend(dst, "auto", cpu_flags(), True)
    assert f"model.backend auto runs {runtime} here: {why}" in out.stderr
    assert ("model.prompt_backend: auto uses them" in out.stderr) == (runtime == "openvino")
    assert {p.name: p.stat().st_mtime_ns for p in dst.iterdir()
            if not p.name.startswith("onnx_")} == ir_files  # the IR's files untouched
    assert sorted(p.name for p in dst.glob("onnx_*")) == sorted(
        [f"onnx_{sub}.onnx" for sub in SUBMODELS])
    assert not list(tmp_path.glob(".*partial*"))
    daemon = Daemon(tmp_path, model=dst, args=["--set", "model.backend=openvino"]).start()
    try:
        with daemon.client() as client:
            status = client.status()
            assert status["model"]["runtime"]["PROMPT_BACKEND"] == \
                "onnxruntime 1.32.0 (weights int8)"
            assert status["batch"]["prompt_runtime"] == "onnxruntime"
            result = client.generate({"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 4, "temperature": 0})
        assert len(result["token_ids"]) == 4
    finally:
        assert daemon.stop() == 0
    again = qvlctl("model", "export-onnx", str(checkpoint), str(dst))
    assert again.returncode == 2 and "already holds ONNX graphs" in again.stderr


def test_pull_converts_a_checkpoint_repository(checkpoint: Path, tmp_path: Path) -> None:
    """#48: a repository holding a transformers checkpoint is downloaded, checked, and
    converted where the convert extra is installed (here), then served."""
    from tests.test_model_pull import REPO, LocalHub
    from tests.test_model_pull import qvlctl as pull_qvlctl

    hub = LocalHub({p.name: p.read_bytes() for p in sorted(checkpoint.iterdir())
                    if p.is_file()})
    try:
        out = pull_qvlctl(hub, tmp_path, "pull", REPO)
        assert out.returncode == 0, out.stderr
        assert "is a transformers checkpoint: converting it (int8 sym per channel" \
            in out.stderr
        dst = tmp_path / "models" / "org--tiny-ov"
        record = json.loads((dst / "qvld-pull.json").read_text())
        assert record["repository"] == REPO and record["converted"].startswith("int8")
        assert (dst / "openvino_language_model.xml").is_file()
        assert not list((tmp_path / "models").glob("*.checkpoint-*"))  # removed once done
        listed = json.loads(pull_qvlctl(hub, tmp_path, "list", "--json").stdout)
        assert [row["name"] for row in listed] == ["org--tiny-ov"]
        info = qvlctl("model", "info", str(dst), "--json")
        assert info.returncode == 0 and json.loads(info.stdout)["backend"] == "openvino"
    finally:
        hub.stop()
