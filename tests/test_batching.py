"""Continuous batching in the real daemon: concurrent clients on one socket share each
step and get exactly the ids they would alone; status shows each running generation
with its tokens so far, and the batch metrics move (read with Prometheus' own parser)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import (
    TINY,
    Daemon,
    free_port,
    load_reference,
    scrape,
    wait_for,
    with_image_bytes,
)

CASES = {c["name"]: c for c in load_reference(TINY)["cases"]}


@pytest.fixture(scope="module")
def batched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    port = free_port()
    daemon = Daemon(tmp_path_factory.mktemp("batched"), metrics_listen=f"127.0.0.1:{port}",
                    args=["--set", "engine.infer_requests=4", "--set", "engine.max_new_tokens=4000",
                          "--set", "engine.max_batch_tokens=64"]).start()
    yield daemon, port
    assert daemon.stop() == 0


def params(case: dict[str, Any]) -> dict[str, Any]:
    return {"messages": with_image_bytes(case["messages"], TINY), "temperature": 0,
            "max_tokens": case["max_new_tokens"], "stream": True}


def test_concurrent_clients_get_exact_answers_and_share_steps(batched: tuple[Daemon, int]
                                                               ) -> None:
    daemon, port = batched
    before = scrape(port)
    cases = [CASES[n] for n in ("long", "image_photo", "two_images_one_message", "question",
                                "image_with_system", "system", "image_gray", "long")]

    def ask(case: dict[str, Any]) -> dict[str, Any]:
        with daemon.client() as client:
            return dict(client.generate(params(case)))

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    for case, answer in zip(cases, answers, strict=True):
        assert answer["token_ids"] == case["token_ids"], case["name"]
    after = scrape(port)
    steps = after[("qvld_batch_sequences_per_step_count", ())]
    assert steps > before.get(("qvld_batch_sequences_per_step_count", ()), 0)
    # At least one step advanced two or more generations together.
    one = ("qvld_batch_sequences_per_step_bucket", (("le", "1.0"),))
    assert after[one] - before.get(one, 0) < steps - before.get(
        ("qvld_batch_sequences_per_step_count", ()), 0)
    assert after[("qvld_kv_cache_usage_ratio", ())] == 0  # every block given back
    assert after[("qvld_batch_sequences", (("state", "decoding"),))] == 0
    # Every prompt row the steps fed, counted as OpenVINO's: the prompts less what each
    # found in the prefix cache.
    rows = ("qvld_prefill_tokens_total", (("runtime", "openvino"),))
    assert after[rows] - before.get(rows, 0) == sum(
        a["usage"]["prompt_tokens"] - a["usage"]["cached_tokens"] for a in answers)


def test_status_shows_each_running_generation_with_its_tokens(batched: tuple[Daemon, int]
                                                              ) -> None:
    daemon, port = batched
    clients = [daemon.client() for _ in range(3)]
    for i, client in enumerate(clients):
        client.send({"id": i, "op": "generate", "params": {
            "messages": [{"role": "user", "content": f"Story {i}"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}})
    try:
        with daemon.client() as admin:
            def three_decoding() -> dict[str, Any] | None:
                batch = admin.status()["batch"]
                running = [s for s in batch["sequences"] if s["generated_tokens"] > 0]
                return batch if len(running) == 3 else None

            batch = wait_for(three_decoding, 60, "three generations decoding")
            assert batch["continuous_batching"] is True
            assert 0 < batch["kv_usage_ratio"] <= 1
            samples = scrape(port)
            assert samples[("qvld_kv_cache_usage_ratio", ())] > 0
            assert samples[("qvld_batch_sequences", (("state", "decoding"),))] >= 3
            shown = subprocess.run([sys.executable, "-m", "qvlctl.cli", "--socket",
                                    str(daemon.socket), "status"], capture_output=True,
                                   text=True, timeout=60)
            # a table of the running generations, one row each
            table = shown.stdout.split("sequences:\n", 1)[-1].split("\n\n")[0].splitlines()
            assert table[0].split() == ["USER", "STATE", "RUNTIME", "PROMPT", "CACHED", "FED",
                                        "GENERATED"], shown.stdout + shown.stderr
            assert len(table) >= 4 and all(row.split()[1:3] in (["decode", "openvino"],
                                                                ["prefill", "openvino"])
                                           for row in table[1:]), shown.stdout
            assert "prompts on openvino" in shown.stdout
            as_json = json.loads(subprocess.run(
                [sys.executable, "-m", "qvlctl.cli", "--socket", str(daemon.socket),
                 "status", "--json"], capture_output=True, text=True, timeout=60).stdout)
            assert len(as_json["batch"]["sequences"]) == 3
    finally:
        for i, client in enumerate(clients):
            client.send({"id": 100 + i, "op": "cancel", "params": {"target": i}})
        for client in clients:
            client.close()
    with daemon.client() as admin:
        wait_for(lambda: not admin.status()["batch"]["sequences"], 30,
                 "the cancelled generations gone")
        assert admin.status()["batch"]["kv_blocks"]["held"] == 0
