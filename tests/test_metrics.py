"""Metrics scraped from the real daemon's HTTP endpoint and parsed with prometheus_client."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from qvld.errors import Busy, ImageInvalid
from qvld.metrics import Metrics, outcome_label
from qvld.protocol import op_label
from tests.conftest import TINY, Daemon, Samples, free_port, scrape, with_image_bytes

ROOT = Path(__file__).resolve().parents[1]
def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp("metered"), metrics_listen=f"127.0.0.1:{port}",
                    args=["--set", "engine.infer_requests=1",
                          "--set", "engine.max_sequences=1", "--set", "server.queue_max=0",
                          "--set", "engine.max_new_tokens=2000"]).start()
    yield daemon, port
    assert daemon.stop() == 0


def test_each_counter_and_histogram_moves_by_what_was_sent(metered: tuple[Daemon, int]
                                                           ) -> None:
    daemon, port = metered
    before = scrape(port)
    case = next(c for c in json.loads((TINY / "reference.json").read_text())["cases"]
                if c["name"] == "image_photo")
    messages = with_image_bytes(case["messages"], TINY)
    with daemon.client() as client:
        ok_results = [client.generate({"messages": messages, "temperature": 0,
                                       "max_tokens": 8}) for _ in range(2)]
        with pytest.raises(ImageInvalid):
            client.generate({"messages": [{"role": "user", "content": [
                {"type": "image", "image": b"junk"}]}]})
        # busy: one generation runs, the queue holds none.
        client.send({"id": 90, "op": "generate", "params": {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}})
        assert client.receive()["event"] == "token"
        with daemon.client() as other, pytest.raises(Busy):
            other.generate({"messages": [{"role": "user", "content": "Hi"}]})
        client.send({"id": 91, "op": "cancel", "params": {"target": 90}})
        replies = {}
        while len(replies) < 2:
            reply = client.receive()
            if "event" not in reply:
                replies[reply["id"]] = reply
        cancelled = replies[90]["result"]
        assert cancelled["finish_reason"] == "cancelled"
        client.send({"id": 92, "op": "dance"})
        assert client.receive()["error"]["code"] == "bad_request"
    after = scrape(port)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("qvld_requests_total", api="socket", op="generate", outcome="ok") == 2
    assert moved("qvld_requests_total", api="socket", op="generate", outcome="image_invalid") == 1
    assert moved("qvld_requests_total", api="socket", op="generate", outcome="busy") == 1
    assert moved("qvld_requests_total", api="socket", op="generate", outcome="cancelled") == 1
    assert moved("qvld_requests_total", api="socket", op="cancel", outcome="ok") == 1
    assert moved("qvld_requests_total", api="socket", op="unknown", outcome="bad_request") == 1
    assert moved("qvld_request_duration_seconds_count", api="socket", op="generate") == 5
    # The two ok generations and the cancelled one reached the engine.
    assert moved("qvld_time_to_first_token_seconds_count") == 3
    assert moved("qvld_queue_wait_seconds_count") == 3
    assert moved("qvld_prefill_seconds_count") == 3
    assert moved("qvld_image_encode_seconds_count") == 2
    generated = sum(r["usage"]["completion_tokens"] for r in ok_results) + len(
        cancelled["token_ids"])
    assert moved("qvld_generated_tokens_total") == generated
    assert moved("qvld_inter_token_latency_seconds_count") == generated - 3
    prompt = sum(r["usage"]["prompt_tokens"] for r in ok_results) + cancelled["usage"][
        "prompt_tokens"]
    assert moved("qvld_prompt_tokens_total") == prompt
    # prefix-cache hit ratio, in tokens: every prompt token looked up, the cached ones hit
    assert moved("qvld_prefix_cache_queries_total") == prompt
    cached = sum(r["usage"]["cached_tokens"] for r in [*ok_results, cancelled])
    assert moved("qvld_prefix_cache_hits_total") == cached > 0
    # The first image was encoded (or came from the prefix); the second reused it.
    assert moved("qvld_image_cache_misses_total") + moved("qvld_image_cache_hits_total") <= 2
    assert moved("qvld_session_cache_hits_total") >= 1
    assert value(after, "qvld_ready") == 1
    assert value(after, "qvld_model_load_seconds") > 0
    info = [labels for (name, labels), v in after.items() if name == "qvld_build_info"]
    assert dict(info[0])["model"] == "tiny" and dict(info[0])["precision"] == "f32"
    assert value(after, "process_resident_memory_bytes") > 0


def test_live_gauges_and_scrape_cost_during_a_generation(metered: tuple[Daemon, int]) -> None:
    daemon, port = metered
    done = threading.Event()

    def generate() -> None:
        with daemon.client() as client:
            client.generate({"messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 1500, "ignore_eos": True})
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    daemon.wait_queue(running=1)
    t0 = time.perf_counter()
    samples = scrape(port)
    cost = time.perf_counter() - t0
    assert value(samples, "qvld_requests_in_flight") == 1
    assert value(samples, "qvld_queue_depth") == 0
    assert value(samples, "qvld_requests_running") == 1
    assert 0 < value(samples, "qvld_kv_cache_usage_ratio") <= 1
    # the block layout, as an endpoint picker's --cache-info-metric reads it
    layout = [dict(labels) for (name, labels), v in samples.items()
              if name == "qvld_cache_config_info" and v == 1]
    assert len(layout) == 1 and int(layout[0]["block_size"]) > 0 \
        and int(layout[0]["num_blocks"]) > 0
    states = {dict(labels)["state"]: v for (name, labels), v in samples.items()
              if name == "qvld_kv_cache_blocks"}
    assert set(states) == {"held", "kept", "cached", "free"} and states["held"] > 0
    assert sum(states.values()) == int(layout[0]["num_blocks"])  # every block, once
    worker.join(60)
    assert done.is_set()
    print(f"one scrape while generating: {cost * 1000:.1f} ms")


def test_metrics_op_and_qvlctl_summary(metered: tuple[Daemon, int]) -> None:
    daemon, _ = metered
    out = daemon.qvlctl("metrics")
    assert out.returncode == 0 and b"qvld_requests_total" in out.stdout
    summary = daemon.qvlctl("metrics", "--summary")
    assert summary.returncode == 0 and b"ready:             yes" in summary.stdout


def test_status_says_what_the_daemon_is_doing(metered: tuple[Daemon, int]) -> None:
    daemon, _ = metered
    with daemon.client() as client:
        status = client.status()
    assert set(status) >= {"generations", "queue", "caches", "last_errors", "model"}
    assert status["caches"]["image"]["entries"] >= 1
    assert any(e["code"] == "image_invalid" for e in status["last_errors"])


def test_dashboard_and_alerts_only_name_metrics_that_exist(metered: tuple[Daemon, int]
                                                           ) -> None:
    _, port = metered
    names = {name for name, _ in scrape(port)}
    dashboard = json.loads((ROOT / "packaging" / "grafana" / "qvld-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((ROOT / "packaging" / "prometheus" / "qvld-alerts.yml").read_text())
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = {m for e in exprs for m in re.findall(r"\b(?:qvld|process)_[a-z_]+", e)}
    assert used and used <= names, used - names


def test_log_lines_never_hold_prompts_by_default(metered: tuple[Daemon, int]) -> None:
    daemon, _ = metered
    with daemon.client() as client:
        client.generate({"messages": [{"role": "user", "content": "secret-words-here"}],
                         "max_tokens": 2})
    log = daemon.log()
    assert "op=generate outcome=ok" in log and "generated_tokens=2" in log
    assert "secret-words-here" not in log


def test_labels_never_come_from_client_input() -> None:
    assert op_label("dance") == "unknown" and op_label(None) == "unknown"
    assert op_label("generate") == "generate"
    assert outcome_label("made-up") == "internal"
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    metrics.observe_request("x" * 100, "weird", 0.1)
    text = metrics.exposition()
    assert 'api="socket",op="unknown",outcome="internal"' in text and "xxxx" not in text
    metrics.observe_request("models", "not_found", 0.1, api="http")
    metrics.observe_request("status", "ok", 0.1, api="http\n")  # neither api nor op made up
    text = metrics.exposition()
    assert 'qvld_requests_total{api="http",op="models",outcome="not_found"} 1.0' in text
    assert 'qvld_requests_total{api="socket",op="status",outcome="ok"} 1.0' in text




def get(port: int, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_only_the_metrics_path_answers_with_metrics(metered: tuple[Daemon, int]) -> None:
    """A load balancer's probe aimed at the metrics port must not pass by accident."""
    _, port = metered
    status, text = get(port, "/metrics")
    assert status == 200 and "qvld_ready" in text
    for path in ("/", "/health", "/metrics/", "/v1/models"):
        assert get(port, path)[0] == 404, path


def test_no_created_series_and_stage_buckets_that_resolve_milliseconds(
        metered: tuple[Daemon, int]) -> None:
    daemon, port = metered
    before = scrape(port)
    with daemon.client() as client:
        client.generate({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    samples = scrape(port)
    assert not [name for name, _ in samples if name.endswith("_created")]
    for name in ("qvld_queue_wait_seconds", "qvld_image_encode_seconds",
                 "qvld_prefill_seconds"):
        bounds = sorted(float(dict(labels)["le"]) for n, labels in samples
                        if n == f"{name}_bucket")
        assert bounds[:3] == [0.001, 0.0025, 0.005], name
    # This request's wait lands in the first bucket that holds it (a few ms on an idle
    # machine, where buckets from 50 ms up put it in 0-50; more beside busy processes).
    def added(name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    assert added("qvld_queue_wait_seconds_count") == 1
    waited = added("qvld_queue_wait_seconds_sum")
    counts = sorted((float(dict(labels)["le"]), added(n, **dict(labels)))
                    for n, labels in samples if n == "qvld_queue_wait_seconds_bucket")
    assert [count for _, count in counts] == [
        float(bound >= waited) for bound, _ in counts], (waited, counts)


def test_json_logs_carry_a_timestamp_and_every_request_field(tmp_path: Path) -> None:
    import datetime

    daemon = Daemon(tmp_path, args=["--set", "logging.format=json"]).start()
    try:
        with daemon.client() as client:
            client.generate({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                             "response_format": {"type": "regex", "pattern": "[a-z]{1,5}"}})
            with pytest.raises(ImageInvalid):
                client.generate({"messages": [{"role": "user", "content": [
                    {"type": "image", "image": b"junk"}]}]})
    finally:
        assert daemon.stop() == 0
    entries = [json.loads(line) for line in daemon.log().splitlines() if line.strip()]
    for entry in entries:
        stamp = datetime.datetime.fromisoformat(entry["ts"])
        assert stamp.tzinfo is not None and re.fullmatch(
            r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00", entry["ts"]), entry["ts"]
        assert entry["level"] in ("debug", "info", "warning", "error", "critical")
    served = next(e for e in entries if e.get("op") == "generate" and e["outcome"] == "ok")
    assert served["api"] == "socket" and isinstance(served["uid"], int)
    assert served["generated_tokens"] >= 1 and isinstance(served["prompt_tokens"], int)
    assert isinstance(served["ttft_s"], float) and isinstance(served["time_s"], float)
    assert served["finish"] == "stop" and served["response_format"] == "regex"
    refused = next(e for e in entries if e.get("outcome") == "image_invalid")
    assert refused["level"] == "warning" and refused["op"] == "generate"
