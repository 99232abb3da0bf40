"""`qvlctl model pull|list` against a local hub: a small HTTP server answering the hub's
API for a repository holding the tiny model's OpenVINO export, reached through
``HF_ENDPOINT`` by the real ``huggingface_hub`` client; then a real daemon serves the
pulled model and `qvlctl ask` answers."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qvld import cli as qvld_cli
from tests.conftest import TINY, Daemon, run_qvlctl

REPO = "org/tiny-ov"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# The tiny model's OpenVINO export as a repository holds it (no ONNX graphs, a README).
FILES = {p.name: p.read_bytes() for p in sorted(TINY.iterdir())
         if p.is_file() and not p.name.startswith(("onnx_", "reference"))}
FILES["README.md"] = b"# tiny-ov\n"
LFS_OVER = 10_000  # files larger than this are LFS files on the hub (sha256 known)


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


class LocalHub:
    """The hub's model-info and resolve endpoints for one repository. ``cut``: a file
    whose GETs without a Range header send ``cut_at`` bytes and drop the connection
    (``cuts`` times); ``served``: bytes served instead of a file's own (the API still
    describes the real file)."""

    def __init__(self, files: dict[str, bytes], cut: str | None = None, cuts: int = 0,
                 cut_at: int = 0, served: dict[str, bytes] | None = None) -> None:
        self.files, self.cut, self.cuts, self.cut_at = files, cut, cuts, cut_at
        self.served = served or {}
        self.ranges: list[tuple[str, str]] = []  # (file, Range header) of range GETs
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                hub.answer(self, body=True)

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def info(self) -> dict[str, Any]:
        siblings = []
        for name, data in self.files.items():
            sibling: dict[str, Any] = {"rfilename": name, "size": len(data),
                                       "blobId": blob_id(data)}
            if len(data) > LFS_OVER:
                sibling["lfs"] = {"size": len(data), "pointerSize": 134,
                                  "sha256": hashlib.sha256(data).hexdigest()}
            siblings.append(sibling)
        return {"id": REPO, "sha": COMMIT, "private": False, "siblings": siblings}

    def answer(self, request: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        path = request.path.split("?")[0]
        if path in (f"/api/models/{REPO}", f"/api/models/{REPO}/revision/main",
                    f"/api/models/{REPO}/revision/{COMMIT}"):
            self.send(request, 200, json.dumps(self.info()).encode(),
                      {"Content-Type": "application/json"}, body)
            return
        prefix = f"/{REPO}/resolve/{COMMIT}/"
        name = path[len(prefix):] if path.startswith(prefix) else None
        if name not in self.files:
            self.send(request, 404, b'{"error": "Entry not found"}',
                      {"X-Error-Code": "EntryNotFound"}, body)
            return
        data = self.served.get(name, self.files[name])
        headers = {"X-Repo-Commit": COMMIT, "Accept-Ranges": "bytes",
                   "ETag": f'"{blob_id(self.files[name])}"'}
        if len(self.files[name]) > LFS_OVER:
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(self.files[name]).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(self.files[name]))
        wanted = request.headers.get("Range")
        if body and wanted:
            self.ranges.append((name, wanted))
            start = int(wanted.removeprefix("bytes=").split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self.send(request, 206, data[start:], headers, body)
            return
        if body and name == self.cut and self.cuts > 0:
            self.cuts -= 1
            request.send_response(200)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                request.send_header(key, value)
            request.end_headers()
            request.wfile.write(data[:self.cut_at])
            request.wfile.flush()
            request.close_connection = True
            return
        self.send(request, 200, data, headers, body)

    @staticmethod
    def send(request: http.server.BaseHTTPRequestHandler, status: int, data: bytes,
             headers: dict[str, str], body: bool) -> None:
        request.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(data))}.items():
            request.send_header(key, value)
        request.end_headers()
        if body:
            request.wfile.write(data)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hubs() -> Iterator[list[LocalHub]]:
    started: list[LocalHub] = []
    yield started
    for hub in started:
        hub.stop()


def qvlctl(hub: LocalHub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"),
           "HF_HUB_DISABLE_TELEMETRY": "1", "QVLD_MODELS": str(tmp_path / "models")}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "qvlctl.cli", "model", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~9 s: a 12 MiB download, a load check and a daemon (default tier < 5 min)
def test_a_pulled_model_is_checked_put_in_place_listed_and_served(
        hubs: list[LocalHub], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A large file is cut off once after its first chunk: the download resumes with a
    # range request; every file is then checked against what the hub says of it.
    from huggingface_hub import constants

    chunk = constants.DOWNLOAD_CHUNK_SIZE
    files = {**FILES, "extra.bin": os.urandom(chunk + (1 << 20))}
    hub = LocalHub(files, cut="extra.bin", cuts=1, cut_at=chunk + 1000)
    hubs.append(hub)
    out = qvlctl(hub, tmp_path, "pull", REPO)
    assert out.returncode == 0, out.stderr
    dst = tmp_path / "models" / "org--tiny-ov"
    assert out.stdout.strip() == str(dst)
    assert hub.ranges == [("extra.bin", f"bytes={chunk}-")]
    for name, data in files.items():
        assert (dst / name).read_bytes() == data
    record = json.loads((dst / "qvld-pull.json").read_text())
    assert (record["repository"], record["commit"]) == (REPO, COMMIT)
    assert "loads and answers" in out.stderr
    assert not list((tmp_path / "models").glob("*.partial-*"))  # renamed into place
    listed = json.loads(qvlctl(hub, tmp_path, "list", "--json").stdout)
    assert [(m["name"], m["repository"], m["commit"]) for m in listed] == [
        ("org--tiny-ov", REPO, COMMIT)]
    assert listed[0]["bytes"] > sum(len(d) for d in FILES.values()) // 2
    again = qvlctl(hub, tmp_path, "pull", REPO)
    assert again.returncode == 0 and "already pulled" in again.stderr
    # `qvld --model org/tiny-ov` finds it by name under the models directory.
    monkeypatch.setenv("QVLD_MODELS", str(tmp_path / "models"))
    _, overrides = qvld_cli.config_source(qvld_cli.build_parser().parse_args(
        ["--model", REPO]))
    assert f"model.path={dst}" in overrides
    (tmp_path / "daemon").mkdir()
    daemon = Daemon(tmp_path / "daemon", model=dst).start()
    try:
        answer = run_qvlctl(daemon.socket, "ask", str(TINY / "images" / "photo.jpg"),
                            "What is this?", "--max-tokens", "4")
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout.strip()
    finally:
        daemon.stop()


def test_a_file_unlike_what_the_hub_describes_is_refused_and_nothing_is_served(
        hubs: list[LocalHub], tmp_path: Path) -> None:
    weights = bytearray(FILES["openvino_language_model.bin"])
    weights[1000] ^= 0xFF  # the same size, another sha256
    hub = LocalHub(FILES, served={"openvino_language_model.bin": bytes(weights)})
    hubs.append(hub)
    out = qvlctl(hub, tmp_path, "pull", REPO, "--no-check")
    assert out.returncode == 4
    assert "openvino_language_model.bin" in out.stderr and "sha256" in out.stderr
    assert not (tmp_path / "models" / "org--tiny-ov").exists()
    assert json.loads(qvlctl(hub, tmp_path, "list", "--json").stdout) == []


def test_a_checkpoint_or_an_unknown_name_is_refused_with_what_to_do(
        hubs: list[LocalHub], tmp_path: Path) -> None:
    checkpoint = {"config.json": FILES["config.json"], "tokenizer.json": FILES["tokenizer.json"],
                  "model.safetensors": b"\0" * 20_000}
    hub = LocalHub(checkpoint)
    hubs.append(hub)
    # Refused with what converts it (--no-convert: as without the convert extra).
    out = qvlctl(hub, tmp_path, "pull", REPO, "--no-convert")
    assert out.returncode == 4
    assert f"qvlctl model convert {REPO} DIR" in out.stderr and "convert extra" in out.stderr
    assert not (tmp_path / "models" / "org--tiny-ov").exists()
    unknown = qvlctl(hub, tmp_path, "pull", "tiny")
    assert unknown.returncode == 4 and "qwen3-vl-2b" in unknown.stderr
    missing = qvlctl(hub, tmp_path, "pull", "org/none")
    assert missing.returncode == 4 and "org/none" in missing.stderr
