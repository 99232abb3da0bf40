"""The real qvld process on the tiny fixture, driven by the real client and CLI."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest
from qvld.errors import ImageInvalid, PromptTooLong
from tests.conftest import TINY, Daemon, load_reference, run_qvlctl, wait_for, with_image_bytes

CASES = {c["name"]: c for c in load_reference(TINY)["cases"]}


def messages_file(tmp_path: Path, case: dict[str, Any], relative: bool = True) -> Path:
    """The case as `qvlctl ask --messages` takes it: image parts name files."""
    images = tmp_path / "pics"
    if not images.exists():
        images.symlink_to(TINY / "images")
    messages = []
    for message in case["messages"]:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image",
                        "image": f"pics/{p['image']}" if relative else str(images / p["image"])}
                       if p["type"] == "image" else p for p in content]
        messages.append({**message, "content": content})
    path = tmp_path / f"{case['name']}.json"
    path.write_text(json.dumps(messages))
    return path


@pytest.mark.parametrize("name", ["system", "longer_than_chunk", "image_exif",
                                  "two_images_one_message", "images_in_two_turns"])
def test_ask_json_messages_equals_engine_and_transformers(daemon: Daemon, tmp_path: Path,
                                                          name: str) -> None:
    case = CASES[name]
    path = messages_file(tmp_path, case, relative=name != "image_exif")
    out = daemon.qvlctl("ask", "--json", "--messages", str(path), "--temperature", "0",
                        "--max-tokens", str(case["max_new_tokens"]))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # exactly one JSON object, nothing else
    assert result["token_ids"] == case["token_ids"]
    engine = Engine(Config(model=ModelConfig(path=TINY, precision="f32",
                                             kv_cache_precision="f32"),
                           engine=EngineConfig(infer_requests=1)))
    local = engine.generate(GenerateRequest(
        messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
        max_tokens=case["max_new_tokens"]))
    assert result["token_ids"] == local.token_ids
    assert result["text"] == local.text
    assert set(result) == {"text", "token_ids", "finish_reason", "usage", "timings"}


def test_ask_streams_text_then_timings(daemon: Daemon) -> None:
    case = CASES["image_photo"]
    out = daemon.qvlctl("ask", str(TINY / "images" / "photo.png"), "What is in this picture?",
                        "--temperature", "0", "--max-tokens", "16")
    assert out.returncode == 0, out.stderr
    with daemon.client() as client:
        expected = client.generate({"messages": with_image_bytes(case["messages"], TINY),
                                    "temperature": 0, "max_tokens": 16})
    assert out.stdout.decode() == expected["text"] + "\n"
    assert b"TTFT" in out.stderr and b"generated" in out.stderr


def test_ask_reads_an_image_from_stdin(daemon: Daemon) -> None:
    data = (TINY / "images" / "small.png").read_bytes()
    out = daemon.qvlctl("ask", "-", "Describe.", "--json", "--max-tokens", "3", stdin=data)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["usage"]["image_tokens"] == 6


def test_streamed_text_concatenates_to_the_final_text(daemon: Daemon) -> None:
    for name in ("non_ascii", "image_gif", "long"):
        case = CASES[name]
        pieces: list[str] = []
        ids: list[int] = []

        def on_token(text: str, new: list[int], pieces: list[str] = pieces,
                     ids: list[int] = ids) -> None:
            pieces.append(text)
            ids.extend(new)

        with daemon.client() as client:
            result = client.generate({"messages": with_image_bytes(case["messages"], TINY),
                                      "temperature": 0,
                                      "max_tokens": case["max_new_tokens"]}, on_token=on_token)
        assert len(pieces) > 1
        assert "".join(pieces) == result["text"]
        assert ids == result["token_ids"] == case["token_ids"]


def test_concurrent_clients_all_get_their_answers(daemon: Daemon) -> None:
    names = ["short", "question", "system", "multi_turn", "image_small", "image_bmp",
             "image_gray", "parts"]
    results: dict[str, Any] = {}

    def ask(name: str) -> None:
        case = CASES[name]
        with daemon.client() as client:
            results[name] = client.generate({
                "messages": with_image_bytes(case["messages"], TINY), "temperature": 0,
                "max_tokens": case["max_new_tokens"]})["token_ids"]

    threads = [threading.Thread(target=ask, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {n: results.get(n) for n in names} == {n: CASES[n]["token_ids"] for n in names}


def test_several_requests_in_flight_on_one_connection(daemon: Daemon) -> None:
    with daemon.client() as client:
        client.send({"id": 1, "op": "generate", "params": {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 300,
            "ignore_eos": True, "temperature": 0}})
        client.send({"id": 2, "op": "health"})
        order = []
        while len(order) < 2:
            reply = client.receive()
            order.append(reply["id"])
    # health is answered while the generation is still running.
    assert order == [2, 1]


def test_health_answers_during_generation(daemon: Daemon) -> None:
    latencies = []
    done = threading.Event()

    def long_generation() -> None:
        with daemon.client() as client:
            client.generate({"messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 500, "ignore_eos": True, "temperature": 0})
        done.set()

    worker = threading.Thread(target=long_generation)
    worker.start()
    with daemon.client() as client:
        wait_for(lambda: done.is_set() or daemon.queue()[0] == 1, 30,
                 "the generation to start")
        while not done.is_set():
            t0 = time.perf_counter()
            assert client.health()["ready"]
            latencies.append(time.perf_counter() - t0)
            if len(latencies) >= 20:
                break
    worker.join(60)
    assert latencies, "the generation ended before health was asked"
    print(f"health latency during generation: max {max(latencies) * 1000:.1f} ms over "
          f"{len(latencies)} calls")


def test_engine_errors_reach_the_client_typed(daemon: Daemon) -> None:
    with daemon.client() as client:
        with pytest.raises(ImageInvalid):
            client.generate({"messages": [{"role": "user", "content": [
                {"type": "image", "image": b"not an image"}]}]})
        with pytest.raises(PromptTooLong):
            client.generate({"messages": [{"role": "user", "content": "word " * 5000}]})
        assert client.health()["ready"]


def test_cancel_op_returns_the_partial_answer(daemon: Daemon) -> None:
    with daemon.client() as client:
        client.send({"id": 7, "op": "generate", "params": {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 500,
            "ignore_eos": True, "temperature": 0, "stream": True}})
        first = client.receive()
        assert first["event"] == "token"
        client.send({"id": 8, "op": "cancel", "params": {"target": 7}})
        replies = {}
        while 7 not in replies or 8 not in replies:
            reply = client.receive()
            if "event" not in reply:
                replies[reply["id"]] = reply
    assert replies[8]["result"] == {"cancelled": True}
    result = replies[7]["result"]
    assert result["finish_reason"] == "cancelled"
    assert 0 < len(result["token_ids"]) < 500


def test_hello_status_and_config(daemon: Daemon) -> None:
    with daemon.client() as client:
        hello = client.hello()
        assert hello["v"] == 1 and hello["model"] == "tiny"
        assert hello["limits"]["max_images"] == 8
        status = client.status()
        assert status["state"] == "ready" and status["model"]["runtime"][
            "INFERENCE_PRECISION_HINT"] == "f32"
        config = client.config()
        assert config["model"]["precision"] == "f32"
        assert config["server"]["socket"] == str(daemon.socket)
    out = daemon.qvlctl("status")
    assert out.returncode == 0 and b"ready" in out.stdout
    shown = out.stdout.decode()
    # For people: the model and human times, no Python reprs of the JSON document.
    assert re.search(r"^qvld +\S+, pid \d+, ready, up [\d.]+ (s|min)", shown, re.M), shown
    assert re.search(r"^model +tiny \(openvino ", shown, re.M), shown
    assert not re.search(r"\b(True|False|None)\b|\[\]|\{|_s:", shown), shown
    assert json.loads(daemon.qvlctl("status", "--json").stdout)["state"] == "ready"


def test_qvlctl_health_exit_codes(daemon: Daemon, tmp_path: Path) -> None:
    assert daemon.qvlctl("health").returncode == 0
    absent = run_qvlctl(tmp_path / "none.sock", "health")
    assert absent.returncode == 3
    assert absent.stderr.count(b"\n") == 1 and b"no daemon" in absent.stderr


def test_qvlctl_errors_are_one_line_with_a_distinct_code(daemon: Daemon,
                                                         tmp_path: Path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"nope")
    out = daemon.qvlctl("ask", str(bad), "What?")
    assert out.returncode == 4
    assert out.stderr.decode().strip().startswith("qvlctl: image_invalid:")
    assert out.stderr.count(b"\n") == 1
    out = daemon.qvlctl("ask", str(tmp_path / "missing.png"), "What?")
    assert out.returncode == 2 and b"cannot read image" in out.stderr
    out = daemon.qvlctl("ask", "--messages", str(bad), "extra")
    assert out.returncode == 2


# -- the socket file ----------------------------------------------------------------


def test_socket_mode_and_stale_socket(tmp_path: Path) -> None:
    stale = tmp_path / "qvld.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(stale))
    sock.close()  # the file stays: a daemon that died without cleaning up
    daemon = Daemon(tmp_path, args=["--set", "server.socket_mode=0640"]).start()
    try:
        assert oct(os.stat(daemon.socket).st_mode & 0o777) == "0o640"
        with daemon.client() as client:
            assert client.health()["ready"]
        # A second daemon must not steal a live daemon's socket.
        other = tmp_path / "other"
        other.mkdir()
        second = Daemon(other, socket_path=daemon.socket).start(wait_ready=False)
        assert second.proc is not None
        assert second.proc.wait(30) == 1
        assert "another daemon is listening" in second.log()
        with daemon.client() as client:
            assert client.health()["ready"]
    finally:
        assert daemon.stop() == 0
    assert not daemon.socket.exists()  # removed on a clean stop


def test_bad_model_dir_exits_78(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, model=tmp_path / "no-model").start(wait_ready=False)
    assert daemon.proc is not None
    assert daemon.proc.wait(30) == 78
    assert "no-model" in daemon.log()
    assert not daemon.socket.exists()


def test_a_metrics_port_in_use_exits_saying_how_to_move_it(tmp_path: Path) -> None:
    """#46: a second daemon meeting the first one's metrics port exited with no hint."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        daemon = Daemon(tmp_path, metrics_listen=f"127.0.0.1:{port}").start(wait_ready=False)
        assert daemon.proc is not None
        assert daemon.proc.wait(60) != 0
    log = daemon.log()
    assert f"cannot serve metrics on 127.0.0.1:{port}" in log
    assert 'metrics.listen to another HOST:PORT, or to ""' in log
    assert not daemon.socket.exists()


def test_sigterm_ends_the_log_with_a_last_line(tmp_path: Path) -> None:
    """#46: nothing was logged after SIGTERM; an operator reading the journal could not
    tell a clean stop from a hang or a kill."""
    daemon = Daemon(tmp_path).start()
    assert daemon.stop() == 0
    lines = daemon.log().strip().splitlines()
    assert "received SIGTERM: draining" in daemon.log()
    assert "stopped after" in lines[-1], lines[-3:]
