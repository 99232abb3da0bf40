"""model.prompt_backend: ONNX Runtime encodes images and prefills prompts, OpenVINO decodes.

On the committed tiny model (IR and ONNX graphs side by side): exact token parity with
transformers at f32 through the split (ONNX Runtime's KV rows copied into OpenVINO's
paged blocks), a shared prefix read back out of the blocks, cancellation mid-prefill
giving every block back, how auto resolves, and a real daemon serving this way.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from qvld.config import Config
from qvld.engine import Engine, GenerateRequest
from qvld.errors import ModelInvalid
from qvld.modeltools.onnx_export import quantize_int8
from tests.conftest import (
    TINY,
    Daemon,
    free_port,
    load_reference,
    outdate_onnx_graphs,
    scrape,
    with_image_bytes,
)

REFERENCE = load_reference(TINY)
CASES = {c["name"]: c for c in REFERENCE["cases"]}


def config(path: Path = TINY, **model: Any) -> Config:
    # f32 compute and an f32 KV cache: the parity the reference tier holds everywhere;
    # OpenVINO decoding, whatever model.backend auto would choose on this CPU.
    return Config.model_validate({
        "model": {"path": str(path), "backend": "openvino", "prompt_backend": "onnxruntime",
                  "precision": "f32",
                  "kv_cache_precision": "f32", **model},
        "engine": {"infer_requests": 2, "prefill_chunk": 64}})


def ask(engine: Engine, case: dict[str, Any], **kw: Any) -> Any:
    return engine.generate(GenerateRequest(
        messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
        max_tokens=case["max_new_tokens"], **kw))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(config())


def test_the_split_is_what_runs(engine: Engine) -> None:
    models: Any = engine.models
    assert models.runtime_properties["PROMPT_BACKEND"].startswith("onnxruntime")
    assert models.vision is None and models.vision_merger is None  # OpenVINO compiled none
    assert engine.batch is not None and engine.batch.model.rows_accessible
    # The first token comes from ONNX Runtime's prefill: the batch steps only decode,
    # one step a token after the first.
    case = CASES["image_photo"]
    steps = engine.batch.steps
    result = ask(engine, case)
    assert engine.batch.steps - steps == len(result.token_ids) - 1


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_ids_equal_transformers(engine: Engine, name: str) -> None:
    assert ask(engine, CASES[name]).token_ids == CASES[name]["token_ids"]


def test_a_shared_prefix_is_read_back_out_of_the_blocks(engine: Engine) -> None:
    # The same long prompt twice: the second reuses the first's full blocks, which ONNX
    # Runtime must read out of OpenVINO's cache to prefill the rest.
    case = max(CASES.values(), key=lambda c: len(c["input_ids"]))
    assert engine.blocks is not None
    assert len(case["input_ids"]) > engine.blocks.block_size
    ask(engine, case)
    again = ask(engine, case)
    assert again.usage.cached_tokens >= engine.blocks.block_size
    assert again.token_ids == case["token_ids"]


def test_a_cancel_during_the_prefill_gives_every_block_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from qvld.engine.model import onnxruntime

    engine = Engine(config().model_copy(update={"engine": config().engine.model_copy(
        update={"prefill_chunk": 8})}))
    assert engine.blocks is not None
    held = engine.blocks.stats()["held"]
    chunks = 0
    step = onnxruntime.Slot.step

    def counted(self: Any, *args: Any) -> Any:
        nonlocal chunks
        chunks += 1
        return step(self, *args)

    monkeypatch.setattr(onnxruntime.Slot, "step", counted)
    case = CASES["image_photo"]
    assert len(case["input_ids"]) > 3 * 8
    result = engine.generate(
        GenerateRequest(messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
                        max_tokens=4), should_stop=lambda: chunks >= 2)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert chunks == 2  # it stopped between the prefill's chunks
    assert engine.blocks.stats()["held"] == held
    monkeypatch.undo()
    assert ask(engine, case).token_ids == case["token_ids"]  # and it serves on


def test_the_watchdog_sees_a_prefill_on_the_prompt_slot(engine: Engine) -> None:
    slot = engine.pool.slots[0]
    assert slot.prompt_slot is not None and not engine.infer_stuck(60)
    slot.prompt_slot.busy_since = time.monotonic() - 120  # a call running for 2 minutes
    try:
        assert engine.infer_stuck(60)
    finally:
        slot.prompt_slot.busy_since = None


def test_the_watchdog_sees_a_prefill_on_the_loops_prompt_slot(engine: Engine) -> None:
    assert engine.batch is not None and engine.batch.prefills is not None
    slot = engine.batch.prefills.slot
    assert all(slot is not s.prompt_slot for s in engine.pool.slots)  # its own
    assert not engine.infer_stuck(60)
    slot.busy_since = time.monotonic() - 120
    try:
        assert engine.infer_stuck(60)
    finally:
        slot.busy_since = None


def test_an_admitted_prompt_is_prefilled_while_every_slot_worker_is_busy(
        engine: Engine) -> None:
    """Once admitted, a prompt's ONNX Runtime prefill does not wait for a slot: with
    every slot held (other users' image encodes), it is prefilled and answered."""
    import threading

    from tests.conftest import wait_for

    case = CASES["image_photo"]
    held, free = threading.Event(), threading.Event()

    def hold_every_slot() -> None:
        with engine.pool.acquire(), engine.pool.acquire():
            held.set()
            free.wait(60)

    batch = engine.batch
    assert batch is not None and len(engine.pool.slots) == 2
    batch.hold()  # admitted only once every slot is taken
    try:
        gen = engine.submit(engine.prepare(GenerateRequest(
            messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
            max_tokens=case["max_new_tokens"])))
        wait_for(lambda: batch.queued() == (0, 1), 60, "its prompt encoded, waiting")
        holder = threading.Thread(target=hold_every_slot)
        holder.start()
        assert held.wait(30)
    finally:
        batch.release()
    try:
        assert gen.future.result(60).token_ids == case["token_ids"]
    finally:
        free.set()
        holder.join()


def test_status_shows_a_prompt_prefilled_on_onnxruntime(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # While ONNX Runtime prefills, the sequence is not in the step loop yet: status and
    # the prefilling count must still show it, with the runtime that computes it.
    from qvld.engine.model import onnxruntime

    assert engine.batch is not None
    seen: list[dict[str, Any]] = []
    step = onnxruntime.Slot.step

    def watched(self: Any, *args: Any) -> Any:
        seen.append(engine.batch_stats())
        return step(self, *args)

    monkeypatch.setattr(onnxruntime.Slot, "step", watched)
    rows: list[tuple[str, int]] = []
    monkeypatch.setattr(engine.batch, "on_prefill", lambda runtime, n: rows.append((runtime, n)))
    result = ask(engine, CASES["long"])
    assert seen and all(s["prompt_runtime"] == "onnxruntime" for s in seen)
    assert [s["prefilling"] for s in seen] == [1] * len(seen)
    fed = []
    for stats in seen:
        [seq] = stats["sequences"]
        assert (seq["state"], seq["runtime"]) == ("prefill", "onnxruntime")
        fed.append(seq["fed_tokens"])
    assert fed == sorted(fed) and fed[0] == result.usage.cached_tokens
    # The prompt's rows were counted once, as ONNX Runtime's; the steps fed none.
    assert rows == [("onnxruntime", result.usage.prompt_tokens - result.usage.cached_tokens)]
    assert engine.batch_stats()["sequences"] == []


def spinning(models: Any) -> str:
    options = models.sessions["language_model"].get_session_options()
    return str(options.get_session_config_entry("session.intra_op.allow_spinning"))


def test_its_threads_do_not_spin_beside_openvinos_unless_asked(engine: Engine) -> None:
    # Beside OpenVINO on the same cores (a prompt prefilled while others decode),
    # spinning ONNX Runtime threads take the CPU from OpenVINO's: off under auto.
    prompt: Any = engine.models.prompt
    assert spinning(prompt) == "0" and prompt.runtime_properties["SPIN_WAIT"] == "off"
    spin = Engine(config().model_copy(update={"engine": config().engine.model_copy(
        update={"spin_wait": True})}))
    assert spinning(spin.models.prompt) == "1"


def test_a_one_token_answer_ends_at_the_prefill(engine: Engine) -> None:
    assert engine.blocks is not None
    held = engine.blocks.stats()["held"]
    case = CASES["image_photo"]
    result = engine.generate(GenerateRequest(
        messages=with_image_bytes(case["messages"], TINY), temperature=0.0, max_tokens=1))
    assert result.token_ids == case["token_ids"][:1] and result.finish_reason == "length"
    assert engine.blocks.stats()["held"] == held


def test_a_u8_cache_keeps_the_prefill_on_openvino(caplog: pytest.LogCaptureFixture) -> None:
    # ONNX Runtime's rows go only into a plain float cache; images still go to it.
    with caplog.at_level("WARNING", logger="qvld.engine"):
        engine = Engine(config(kv_cache_precision="u8"))
    assert engine.batch is not None and not engine.batch.model.rows_accessible
    assert "prefilled by OpenVINO" in caplog.text
    assert engine.batch_stats()["prompt_runtime"] == "openvino"
    steps = engine.batch.steps
    result = ask(engine, CASES["image_photo"])
    assert engine.batch.steps - steps >= len(result.token_ids)  # the prefill stepped too


def test_auto_takes_int8_graphs_and_leaves_float_ones(tmp_path: Path) -> None:
    # The tiny graphs are fp32: no faster than OpenVINO's, so auto keeps OpenVINO.
    plain = Engine(config(prompt_backend="auto"))
    assert plain.models.prompt is None
    assert "PROMPT_BACKEND" not in plain.models.runtime_properties
    model = tmp_path / "tiny-int8"
    shutil.copytree(TINY, model)
    quantize_int8(model)
    from qvld.engine.model.model_dir import onnx_weights

    assert onnx_weights(model / "onnx_language_model.onnx") == "int8"
    int8 = Engine(config(model, prompt_backend="auto"))
    assert int8.models.runtime_properties["PROMPT_BACKEND"] == "onnxruntime 1.32.0 (weights int8)"
    assert len(ask(int8, CASES["image_photo"]).token_ids) == CASES["image_photo"][
        "max_new_tokens"]
    alone = Engine(Config.model_validate({
        "model": {"path": str(model), "backend": "openvino"},
        "engine": {"continuous_batching": False}}))
    assert alone.models.prompt is None  # rows go into a paged cache only


def test_the_weights_are_read_from_the_graph_file_without_loading_it(tmp_path: Path) -> None:
    from qvld.engine.model.model_dir import onnx_weights

    assert onnx_weights(TINY / "onnx_language_model.onnx") == "fp32"
    assert onnx_weights(TINY / "onnx_vision_embeddings_merger_model.onnx") == "fp32"
    stray = tmp_path / "other.onnx"
    stray.write_bytes(b"\x08\x07" + bytes(4096))  # a graph nobody annotated
    assert onnx_weights(stray) is None


def test_onnxruntime_without_graphs_says_how_to_make_them(tmp_path: Path) -> None:
    model = tmp_path / "ir-only"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("onnx_*"))
    with pytest.raises(ModelInvalid, match="export-onnx"):
        Engine(config(model))
    assert Engine(config(model, prompt_backend="auto")).models.prompt is None


def test_daemon_serves_with_prompts_on_onnxruntime(tmp_path: Path) -> None:
    port = free_port()
    daemon = Daemon(tmp_path, metrics_listen=f"127.0.0.1:{port}",
                    args=["--set", "model.prompt_backend=onnxruntime",
                                    "--set", "model.precision=f32",
                                    "--set", "model.kv_cache_precision=f32"]).start()
    try:
        case = CASES["image_photo"]
        with daemon.client() as client:
            status = client.status()
            assert status["model"]["runtime"]["PROMPT_BACKEND"].startswith("onnxruntime")
            assert status["batch"]["prompt_runtime"] == "onnxruntime"
            before = scrape(port)
            rows = ("qvld_prefill_tokens_total", (("runtime", "onnxruntime"),))
            assert before[rows] == 0  # shown before it has run (the warm-up is not counted)
            computed = 0
            for _ in range(2):  # the second from the image cache and the prefix cache
                result = client.generate({"messages": with_image_bytes(case["messages"], TINY),
                                          "max_tokens": case["max_new_tokens"],
                                          "temperature": 0})
                assert result["token_ids"] == case["token_ids"]
                usage = result["usage"]
                computed += usage["prompt_tokens"] - usage["cached_tokens"]
            after = scrape(port)
            assert after[rows] == computed > 0
            assert after.get(("qvld_prefill_tokens_total", (("runtime", "openvino"),)), 0) == 0
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_prompt_prefilled_elsewhere_waits_for_its_compile_without_holding_a_slot(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime prefills a prompt whose response format is still compiling: the slot
    keeps the logits for the step loop and is free again at once (another request is
    answered meanwhile); the first token comes when the compile ends."""
    import json
    import threading

    from qvld.engine.decoding.constraints import GrammarCompiler
    from qvld.engine.decoding.response_format import parse_response_format
    from tests.conftest import wait_for

    slow = threading.Event()
    compile_ = GrammarCompiler._compile

    def late(self: GrammarCompiler, fmt: Any) -> Any:
        assert slow.wait(30)
        return compile_(self, fmt)

    monkeypatch.setattr(GrammarCompiler, "_compile", late)
    schema = {"type": "object", "properties": {"late": {"type": "boolean"}},
              "required": ["late"]}
    prepared = engine.prepare(GenerateRequest(
        messages=with_image_bytes(CASES["image_photo"]["messages"], TINY), max_tokens=30,
        temperature=0.0, response_format=parse_response_format(
            {"type": "json_schema", "schema": schema})))
    gen = engine.submit(prepared)
    try:
        wait_for(lambda: gen.seq is not None and gen.seq.logits is not None
                 and not gen.seq.outside, 60, "the prompt prefilled, its token waiting")
        # Both slots are free: a plain request is answered while the compile runs.
        assert ask(engine, CASES["image_photo"]).finish_reason in ("stop", "length")
        assert not gen.future.done()
    finally:
        slow.set()
    result = gen.future.result(60)
    assert json.loads(result.text)["late"] in (True, False)


AVX2 = {"avx2", "fma", "f16c"}  # this project's usual AMD EPYC: no int8 dot products


def int8_directory(tmp_path: Path) -> Path:
    model = tmp_path / "tiny-int8"
    shutil.copytree(TINY, model)
    quantize_int8(model)
    return model


def test_auto_runs_everything_on_onnxruntime_only_where_openvino_lacks_int8_dot_products(
        tmp_path: Path) -> None:
    from qvld.engine.model.model_dir import choose_backend

    model = int8_directory(tmp_path)
    assert choose_backend(model, "auto", AVX2, True)[0] == "onnxruntime"
    for flags in ({"avx2", "avx_vnni"}, {"avx512f", "avx512_vnni"}, {"amx_int8", "avx512f"}):
        runtime, why = choose_backend(model, "auto", flags, True)
        assert runtime == "openvino" and "dot products" in why, flags
    # Float graphs are no faster than the IR; without onnxruntime there is no choice;
    # an explicit split (prompts on ONNX Runtime) means OpenVINO decodes.
    assert choose_backend(TINY, "auto", AVX2, True) == (
        "openvino", "its ONNX graphs have float weights (no faster than the IR)")
    assert choose_backend(model, "auto", AVX2, False)[0] == "openvino"
    assert choose_backend(model, "auto", AVX2, True, prompt_backend="onnxruntime")[0] == \
        "openvino"
    assert choose_backend(model, "openvino", AVX2, True)[0] == "openvino"
    # A directory with one runtime's graphs runs on that runtime.
    ir_only = tmp_path / "ir-only"
    shutil.copytree(model, ir_only, ignore=shutil.ignore_patterns("onnx_*"))
    onnx_only = tmp_path / "onnx-only"
    shutil.copytree(model, onnx_only, ignore=shutil.ignore_patterns("openvino_*"))
    assert choose_backend(ir_only, "auto", AVX2, True)[0] == "openvino"
    assert choose_backend(onnx_only, "auto", {"amx_int8"}, True)[0] == "onnxruntime"


def test_the_engine_and_check_config_run_what_auto_chooses_on_this_cpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from qvld.cli import main
    from qvld.engine.model.model_dir import choose_backend
    from qvld.system import System

    model = int8_directory(tmp_path)
    expected, why = choose_backend(model, "auto", System().cpu_flags(), True)
    engine = Engine(Config.model_validate({"model": {"path": str(model)}}))
    assert engine.models.runtime == expected and engine.config.model.backend == expected
    assert engine.models.prompt is None if expected == "onnxruntime" else True
    answer = ask(engine, CASES["image_photo"])
    assert len(answer.token_ids) == CASES["image_photo"]["max_new_tokens"]
    config = tmp_path / "qvld.yaml"
    config.write_text(f"model:\n  path: {model}\n")
    assert main(["check-config", "--config", str(config)]) == 0
    assert f"runtime: {expected} ({why})" in capsys.readouterr().out


@pytest.mark.parametrize(("key", "reason"), [
    ("qvld.kv_cache", "its KV cache is copied every step"),
    ("qvld.int8_activations", "its int8 activations share one scale across a batch")])
def test_graphs_exported_before_the_in_place_cache_or_per_row_int8_are_passed_over_or_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, reason: str) -> None:
    from qvld.engine.model.model_dir import choose_backend, onnx_outdated

    model = int8_directory(tmp_path)
    assert onnx_outdated(model) is None
    outdate_onnx_graphs(model, key)  # what an older export wrote
    why = onnx_outdated(model)
    assert why is not None and f"export-onnx CHECKPOINT {model} --weights int8" in why
    assert reason in why
    assert choose_backend(model, "auto", AVX2, True) == ("openvino", why)
    # auto: OpenVINO runs everything (no prompt backend), and the log says how to mend it.
    with caplog.at_level(logging.WARNING, logger="qvld.engine"):
        engine = Engine(Config.model_validate({"model": {"path": str(model)}}))
    assert engine.models.runtime == "openvino" and engine.models.prompt is None
    assert "exported by an older qvld" in caplog.text
    assert len(ask(engine, CASES["image_photo"]).token_ids) == CASES["image_photo"][
        "max_new_tokens"]
    # Named, it is a typed error that says the same.
    for named in ({"backend": "onnxruntime"}, {"backend": "openvino",
                                                "prompt_backend": "onnxruntime"}):
        with pytest.raises(ModelInvalid, match="exported by an older qvld"):
            Engine(Config.model_validate({"model": {"path": str(model), **named}}))
