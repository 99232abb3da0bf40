"""The compiled-model cache (model.cache_dir): keyed by what was compiled, verified
before OpenVINO imports it, refused where others could write it."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import openvino as ov
import pytest

from qvld.config import Config
from qvld.engine import Engine, GenerateRequest
from qvld.engine.model.compiled_cache import MANIFEST, cache_key
from qvld.engine.model.model_dir import load_model_spec
from tests.conftest import parity_config

REQUEST = GenerateRequest(messages=[{"role": "user", "content": "Count to five."}],
                          max_tokens=8, temperature=0.0)


def cached(model: Path, cache: Path | None) -> Config:
    config = parity_config(model, infer_requests=1)
    return config.model_copy(update={"model": config.model.model_copy(
        update={"cache_dir": cache})})


def answer(model: Path, cache: Path | None) -> list[int]:
    return list(Engine(cached(model, cache)).generate(REQUEST).token_ids)


def blobs(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.blob"))


def cache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "model.cache_dir" in r.getMessage()]


def overwrite_middle(path: Path) -> None:
    """What the red team did: bytes in the middle of the blob, same size."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.chmod(0o600)  # OpenVINO writes its blobs read-only
    path.write_bytes(bytes(data))


@pytest.fixture(autouse=True)
def qvld_logs_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    # An in-process daemon elsewhere in the run may have set up qvld's own handler.
    monkeypatch.setattr(logging.getLogger("qvld"), "propagate", True)


@pytest.fixture(scope="module")
def reference_ids(tiny_dir: Path) -> list[int]:
    return answer(tiny_dir, None)


def test_blobs_are_recorded_in_a_manifest_beside_them(tiny_dir: Path, tmp_path: Path,
                                                      reference_ids: list[int]) -> None:
    assert answer(tiny_dir, tmp_path) == reference_ids
    (subdir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    manifest = json.loads((subdir / MANIFEST).read_text())["blobs"]
    assert sorted(manifest) == [p.name for p in blobs(tmp_path)] and len(manifest) == 5
    for blob in blobs(tmp_path):
        assert manifest[blob.name]["size"] == blob.stat().st_size
    assert not [p for p in subdir.iterdir() if p.name.startswith(f".{MANIFEST}")], \
        "a temporary manifest was left behind"


@pytest.mark.parametrize("damage", ["overwritten bytes", "no manifest", "unknown blob"])
def test_a_damaged_cache_is_discarded_and_answers_stay_right(
        tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        reference_ids: list[int], damage: str) -> None:
    answer(tiny_dir, tmp_path)  # fills the cache
    (subdir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    if damage == "overwritten bytes":
        for blob in blobs(tmp_path):
            overwrite_middle(blob)
    elif damage == "no manifest":
        (subdir / MANIFEST).unlink()
    else:
        shutil.copy(blobs(tmp_path)[0], subdir / "1234.blob")
    named = {"overwritten bytes": blobs(tmp_path)[0].name, "no manifest": MANIFEST,
             "unknown blob": "1234.blob"}[damage]
    with caplog.at_level(logging.WARNING, logger="qvld"):
        assert answer(tiny_dir, tmp_path) == reference_ids  # all 0 when the blob was used
    (warning,) = cache_warnings(caplog)
    assert named in warning and "compiling afresh" in warning
    # The fresh compile rewrote the blobs and the manifest: the next start trusts them.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qvld"):
        assert answer(tiny_dir, tmp_path) == reference_ids
    assert cache_warnings(caplog) == []
    assert not (subdir / "1234.blob").exists()


@pytest.mark.parametrize(("mode", "used"), [(0o777, False), (0o775, False), (0o1777, True),
                                            (0o755, True)])
def test_a_cache_dir_others_can_write_is_not_used(tiny_dir: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture,
                                                  reference_ids: list[int], mode: int,
                                                  used: bool) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(mode)
    with caplog.at_level(logging.WARNING, logger="qvld"):
        assert answer(tiny_dir, cache) == reference_ids
    warnings = cache_warnings(caplog)
    if used:
        assert blobs(cache) and warnings == []
    else:
        assert blobs(cache) == [], "compiled into a directory others can write"
        (warning,) = warnings
        assert "writable by others" in warning and f"chmod go-w {cache}" in warning


def test_a_subdirectory_others_can_write_is_not_used(tiny_dir: Path, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    answer(tiny_dir, tmp_path)
    (subdir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    subdir.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="qvld"):
        engine = Engine(cached(tiny_dir, tmp_path))
    (warning,) = cache_warnings(caplog)
    assert str(subdir) in warning and "chmod go-w" in warning
    assert not {str(p.resolve()) for p in blobs(tmp_path)} & engine.models.weight_files


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_cache_dir_owned_by_someone_else_is_not_used(tiny_dir: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chown(cache, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="qvld"):
        Engine(cached(tiny_dir, cache))
    (warning,) = cache_warnings(caplog)
    assert "owned by uid 65534" in warning and f"chown 0 {cache}" in warning
    assert blobs(cache) == []


def key_of(model: Path, **engine: object) -> str:
    from qvld.engine.model.openvino import compile_properties

    config = cached(model, None)
    if engine:
        config = config.model_copy(update={"engine": config.engine.model_copy(update=engine)})
    props = {"language_model": compile_properties(config.model, config.engine)}
    return cache_key(load_model_spec(model, "openvino"), f"openvino {ov.__version__}", "CPU", props)


def test_the_cache_is_keyed_by_the_model_files_and_the_settings(tiny_dir: Path,
                                                                 tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    first = key_of(model)
    assert key_of(model) == first
    assert key_of(model, threads=3) != first
    xml = model / "openvino_text_embeddings_model.xml"
    xml.write_text(xml.read_text() + "\n")
    changed_xml = key_of(model)
    assert changed_xml != first
    # Same size, same mtime, other bytes (cp --preserve of another export): the sampled
    # blocks of the .bin see it.
    weights = model / "openvino_language_model.bin"
    info = weights.stat()
    with open(weights, "r+b") as f:
        f.write(b"\x7f" * 16)
    os.utime(weights, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert key_of(model) != changed_xml


def test_a_changed_model_compiles_into_another_subdirectory(tiny_dir: Path,
                                                            tmp_path: Path) -> None:
    model, cache = tmp_path / "model", tmp_path / "cache"
    shutil.copytree(tiny_dir, model)
    Engine(cached(model, cache))
    before = {p.name for p in cache.iterdir()}
    xml = model / "openvino_vision_embeddings_pos_model.xml"
    xml.write_text(xml.read_text() + "\n")
    Engine(cached(model, cache))
    after = {p.name for p in cache.iterdir()}
    assert len(before) == 1 and len(after) == 2 and before < after
