"""The ONNX Runtime backend (model.backend: onnxruntime) on the committed tiny graphs.

The same reference cases and sessions as the OpenVINO backend, exact at fp32; the KV
cache bound between steps and trimmed to a common prefix; the int8 graphs from
onnxruntime's quantiser; a real daemon serving on this backend.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest
from qvld.engine.model.model_dir import SUBMODELS
from qvld.errors import ModelInvalid, QvlError
from qvld.modeltools.onnx_export import quantize_int8, save_graph
from tests.conftest import TINY, Daemon, load_reference, with_image_bytes

REFERENCE = load_reference(TINY)
CASES = {c["name"]: c for c in REFERENCE["cases"]}
SESSIONS = REFERENCE["sessions"]


def ort_config(path: Path = TINY, **engine: Any) -> Config:
    return Config(model=ModelConfig(path=path, backend="onnxruntime"),
                  engine=EngineConfig(**{"infer_requests": 2, **engine}))


def ask(engine: Engine, case: dict[str, Any], path: Path = TINY, **kw: Any) -> Any:
    return engine.generate(GenerateRequest(
        messages=with_image_bytes(case["messages"], path), temperature=0.0,
        max_tokens=case["max_new_tokens"], **kw))


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(ort_config(prefill_chunk=64))


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_ids_equal_transformers(engine: Engine, name: str) -> None:
    assert ask(engine, CASES[name]).token_ids == CASES[name]["token_ids"]


def test_decoding_sequences_share_a_step_and_status_says_they_do(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    # ONNX Runtime has no paged attention: concurrent generations share the step loop,
    # prompts on slots over the same KV blocks and decoding sequences in one inference
    # (the decode lane), exactly. engine.batch_invariant, which stepped them one by one,
    # is a deprecated no-op: the engine says so and still batches.
    from concurrent.futures import ThreadPoolExecutor

    assert engine.stats()["batch"]["continuous_batching"] is True
    with caplog.at_level("WARNING", logger="qvld"):
        deprecated = Engine(engine.config.model_copy(update={
            "engine": engine.config.engine.model_copy(update={"batch_invariant": True})}))
    assert "engine.batch_invariant is deprecated and has no effect" in caplog.text
    assert deprecated.stats()["batch"]["continuous_batching"] is True
    peak = engine.batch.peak_sequences
    cases = [CASES[n] for n in ("image_photo", "long", "question")]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: ask(engine, case), cases))
    assert [r.token_ids for r in results] == [c["token_ids"] for c in cases]
    assert engine.stats()["batch"]["steps"] > 0 and engine.batch.peak_sequences >= peak


@pytest.mark.parametrize("session", SESSIONS, ids=[s["name"] for s in SESSIONS])
def test_session_turns_equal_transformers(session: dict[str, Any]) -> None:
    engine = Engine(ort_config())
    for n, turn in enumerate(session["turns"]):
        result = ask(engine, turn, session="s")
        assert result.token_ids == turn["token_ids"], f"turn {n}"
        if n:  # the history came from the KV blocks (the block pool's prefix cache)
            size = engine.blocks.block_size
            previous = len(session["turns"][n - 1]["input_ids"])
            assert result.usage.cached_tokens >= previous // size * size


@pytest.mark.parametrize("name", ["longer_than_chunk", "two_images_one_message"])
def test_chunked_prefill_through_the_past_inputs_is_exact(name: str) -> None:
    # Chunks of 5 rows: every chunk after the first reads the cache as past_key_values.
    engine = Engine(ort_config(prefill_chunk=5, infer_requests=1))
    assert ask(engine, CASES[name]).token_ids == CASES[name]["token_ids"]


def test_a_prefix_shared_in_whole_blocks_is_reused() -> None:
    # The same 131-row prompt again: its rows are cached in whole blocks (all but the
    # last row, whose logits give the first token). The decode lane took the first
    # answer's rows and the slot let its copy go (memory), so they are loaded from the
    # blocks once (without a lane, test_slot_paged: the slot is cut back to them).
    engine = Engine(ort_config(infer_requests=1))
    first, second = ask(engine, CASES["long"]), ask(engine, CASES["long"])
    size = engine.blocks.block_size
    assert second.usage.cached_tokens == 130 // size * size
    model = engine.batch.model
    assert (model.reloads, model.lane_loads > 0) == (1, True)  # type: ignore[attr-defined]
    assert first.token_ids == second.token_ids == CASES["long"]["token_ids"]


def test_the_kv_cache_is_written_in_place_between_steps(engine: Engine) -> None:
    spec = engine.spec
    with engine.pool.acquire() as slot:
        slot.reset()
        embeds = slot.embed(np.array([5, 6, 7]))
        positions = np.tile(np.arange(3), (3, 1))
        first = slot.step(embeds, positions, np.zeros(3, bool), slot.no_deepstack()).copy()
        cache = slot._caches  # type: ignore[attr-defined]
        assert len(cache) == 2 * spec.num_layers
        capacity = cache[0].shape[2]
        assert cache[0].shape == (1, spec.num_kv_heads, capacity, spec.head_dim)
        assert capacity >= 4
        rows = [c[:, :, :3].copy() for c in cache]
        slot.step(slot.embed(np.array([8])), np.full((3, 1), 3), np.zeros(1, bool),
                  slot.no_deepstack())
        # The same buffers: the new row was written after the three, which stayed.
        assert all(a is b for a, b in zip(slot._caches, cache, strict=True))  # type: ignore[attr-defined]
        assert slot.past_len == 4
        for before, after in zip(rows, slot.rows_from(0), strict=True):
            np.testing.assert_array_equal(after[:, :, :3], before)
            assert after.shape[2] == 4 and np.abs(after[:, :, 3]).sum() > 0
        # Trimmed to the first 2 rows, the third row again gives the logits it gave.
        slot.trim(2)
        again = slot.step(slot.embed(np.array([7])), np.full((3, 1), 2), np.zeros(1, bool),
                          slot.no_deepstack())
        np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-5)
        slot.reset()


def test_a_cache_that_outgrows_its_buffers_keeps_its_rows(engine: Engine) -> None:
    from qvld.engine.model.onnxruntime import PRESENT_ROWS

    spec = engine.spec
    rng = np.random.default_rng(7)
    past = PRESENT_ROWS - 1
    kv = [rng.standard_normal((1, spec.num_kv_heads, past, spec.head_dim)).astype(np.float32)
          for _ in range(2 * spec.num_layers)]
    with engine.pool.acquire() as one_by_one, engine.pool.acquire() as together:
        embeds = one_by_one.embed(np.array([11, 12]))
        positions = np.tile(np.arange(past, past + 2), (3, 1))
        one_by_one.load_rows(kv)
        together.load_rows(kv)
        for i in range(2):  # the second row is the 257th: the buffers grow under it
            stepped = one_by_one.step(embeds[i:i + 1], positions[:, i:i + 1],
                                      np.zeros(1, bool), one_by_one.no_deepstack())
        both = together.step(embeds, positions, np.zeros(2, bool), together.no_deepstack())
        np.testing.assert_allclose(stepped, both, rtol=1e-4, atol=1e-4)
        assert one_by_one._caches[0].shape[2] == 2 * PRESENT_ROWS  # type: ignore[attr-defined]
        for mine, theirs, loaded in zip(one_by_one.rows_from(0), together.rows_from(0), kv,
                                        strict=True):
            assert mine.shape[2] == past + 2
            np.testing.assert_array_equal(mine[:, :, :past], loaded)
            np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5)
        one_by_one.reset()
        together.reset()


def test_runtime_properties_and_threads() -> None:
    engine = Engine(ort_config(threads=1, infer_requests=1))
    props = engine.models.runtime_properties
    assert props["BACKEND"] == f"onnxruntime {ort.__version__}"
    assert props["INFERENCE_NUM_THREADS"] == "1" and props["WEIGHTS"] == "fp32"
    assert props["INFERENCE_PRECISION_HINT"] == "f32"
    assert engine.models.kv_bytes_per_token == 2 * 3 * 2 * 32 * 4  # f32, 3 layers, 2 heads


def test_alone_its_threads_spin_unless_told_not_to(engine: Engine) -> None:
    def spinning(models: Any) -> str:
        options = models.sessions["language_model"].get_session_options()
        return str(options.get_session_config_entry("session.intra_op.allow_spinning"))

    assert spinning(engine.models) == "1"  # auto: nothing else runs on these cores
    assert engine.models.runtime_properties["SPIN_WAIT"] == "on"
    assert spinning(Engine(ort_config(spin_wait=False)).models) == "0"


def test_int8_graphs_quantise_the_matmuls_and_still_answer(tmp_path: Path,
                                                           engine: Engine) -> None:
    model = tmp_path / "tiny-int8"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("openvino_*"))
    quantize_int8(model)
    lm = onnx.load(str(model / "onnx_language_model.onnx"))
    ops = {node.op_type for node in lm.graph.node}
    # weights in int8, activations quantised per row (no per-tensor DynamicQuantizeLinear)
    assert {"MatMulIntegerToFloat", "QuantizeLinear"} <= ops
    assert "DynamicQuantizeLinear" not in ops
    props = {p.key: p.value for p in lm.metadata_props}
    assert props["qvld.weights"] == "int8" and props["qvld.int8_activations"] == "per-row"
    assert (model / "onnx_language_model.onnx").stat().st_size < \
        0.5 * (TINY / "onnx_language_model.onnx").stat().st_size
    assert not list(model.glob("*.int8.onnx*"))
    int8 = Engine(ort_config(model, infer_requests=1))
    assert int8.models.runtime_properties["WEIGHTS"] == "int8"
    # The first prediction of each text case stays close to fp32's (random weights make
    # later tokens diverge: only the logits are compared).
    for name in ("short", "question", "system", "non_ascii"):
        case = CASES[name]
        logits = []
        for eng in (engine, int8):
            with eng.pool.acquire() as slot:
                slot.reset()
                ids = np.asarray(case["input_ids"])
                positions = np.tile(np.arange(len(ids)), (3, 1))
                logits.append(slot.step(slot.embed(ids), positions, np.zeros(len(ids), bool),
                                        slot.no_deepstack()).copy())
                slot.reset()
        cosine = logits[0] @ logits[1] / np.linalg.norm(logits[0]) / np.linalg.norm(logits[1])
        assert cosine > 0.99, name
    assert len(ask(int8, CASES["image_photo"], model).token_ids) == 16
    # `qvlctl model info` reads an ONNX-only directory and its weight types.
    from qvld.modeltools.convert import info

    document = info(model)
    assert document["backend"] == "onnxruntime" and document["loadable"]
    assert document["language_model_layout"] == "int8"
    language = document["weights"]["language_model"]
    assert max(language, key=language.get) == "int8", language


def test_the_merger_is_fused_needs_no_mask_and_an_older_graph_is_fed_one(tmp_path: Path
                                                                       ) -> None:
    # Graphs are exported without the vision merger's attention mask (one image per call:
    # all zeros); graphs exported before take one, and ONNX Runtime refuses a run that
    # leaves a declared input unfed: a directory of those must still answer exactly.
    graph = onnx.load(str(TINY / "onnx_vision_embeddings_merger_model.onnx"))
    assert [i.name for i in graph.graph.input] == ["hidden_states", "rotary_pos_emb"]
    ops = {node.op_type for node in graph.graph.node}
    assert "Gelu" in ops  # opset 20: one op
    # and ONNX Runtime's fused rotary embedding and attention (the parity above holds)
    assert {"RotaryEmbedding", "MultiHeadAttention"} <= ops and "Softmax" not in ops
    older = tmp_path / "older"
    shutil.copytree(TINY, older)
    graph.graph.input.insert(1, onnx.helper.make_tensor_value_info(
        "attention_mask", onnx.TensorProto.FLOAT, [1, "patches", "patches"]))
    onnx.save(graph, str(older / "onnx_vision_embeddings_merger_model.onnx"))
    case = CASES["image_photo"]
    assert ask(Engine(ort_config(older)), case, TINY).token_ids == case["token_ids"]


def test_large_graphs_keep_their_weights_in_one_aligned_data_file(tmp_path: Path) -> None:
    # What the exporter gets for a full-size graph: one external file per tensor.
    scattered = tmp_path / "traced" / "model.onnx"
    scattered.parent.mkdir()
    source = TINY / "onnx_text_embeddings_model.onnx"
    onnx.save_model(onnx.load(str(source)), str(scattered), save_as_external_data=True,
                    all_tensors_to_one_file=False, size_threshold=0)
    assert len(list(scattered.parent.iterdir())) > 1
    saved = tmp_path / "onnx_text_embeddings_model.onnx"
    save_graph(scattered, saved, "fp32")
    data = saved.with_name(saved.name + ".data")
    graph = onnx.load(str(saved), load_external_data=False)
    for tensor in graph.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            assert info["location"] == data.name and int(info["offset"]) % 4096 == 0
    ids = np.array([[1, 2, 3]])
    want = ort.InferenceSession(str(source)).run(None, {"input": ids})[0]
    got = ort.InferenceSession(str(saved)).run(None, {"input": ids})[0]
    np.testing.assert_array_equal(got, want)


def test_bf16_or_a_compressed_kv_cache_is_refused() -> None:
    for setting in ({"precision": "bf16"}, {"kv_cache_precision": "u8"}):
        with pytest.raises(ModelInvalid, match="onnxruntime backend computes at f32"):
            Engine(Config(model=ModelConfig(path=TINY, backend="onnxruntime", **setting)))


def test_a_directory_without_onnx_graphs_says_how_to_make_them(tmp_path: Path) -> None:
    model = tmp_path / "ir-only"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("onnx_*"))
    with pytest.raises(ModelInvalid, match="qvlctl model export-onnx"):
        Engine(ort_config(model))
    # A broken graph is a typed error too, naming the file.
    shutil.copytree(TINY, tmp_path / "broken")
    (tmp_path / "broken" / "onnx_language_model.onnx").write_bytes(b"not a graph")
    with pytest.raises(ModelInvalid, match=r"onnx_language_model\.onnx cannot be loaded"):
        Engine(ort_config(tmp_path / "broken"))


def test_check_config_reads_an_onnx_only_directory_for_the_configured_backend(
        tmp_path: Path) -> None:
    # What `qvlctl model export-onnx` writes: onnx_*.onnx graphs and no OpenVINO IR.
    model = tmp_path / "onnx-only"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("openvino_*"))
    empty = tmp_path / "qvld.yaml"
    empty.write_text("")

    def check(backend: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "qvld.cli", "check-config", "--config",
                               str(empty), "--model", str(model), "--set",
                               f"model.backend={backend}"],
                              capture_output=True, text=True, timeout=60, check=False)

    ok = check("onnxruntime")
    assert ok.returncode == 0, ok.stderr
    assert "configuration is valid" in ok.stdout
    refused = check("openvino")
    assert refused.returncode == 78, refused.stderr
    assert "lacks openvino_" in refused.stderr and "qvlctl model convert" in refused.stderr


def test_every_submodel_has_its_graph() -> None:
    for submodel in SUBMODELS:
        graph = onnx.load(str(TINY / f"onnx_{submodel}.onnx"))
        assert {p.key: p.value for p in graph.metadata_props}["qvld.weights"] == "fp32"
    lm = ort.InferenceSession(str(TINY / "onnx_language_model.onnx"))
    inputs = {i.name: i.shape for i in lm.get_inputs()}
    # Explicit past key/values with dynamic batch and capacity, not a stateful graph,
    # written in place by GroupQueryAttention at each sequence's length.
    assert inputs["past_key_values.0.key"] == ["batch", 2, "capacity", 32]
    assert inputs["inputs_embeds"] == ["batch", "seq", 128]
    assert inputs["seqlens_k"] == ["batch"] and inputs["total_sequence_length"] == []
    assert "attention_mask" not in inputs
    assert [o.name for o in lm.get_outputs()][:2] == ["logits", "present.0.key"]
    graph = onnx.load(str(TINY / "onnx_language_model.onnx"), load_external_data=False)
    assert sum(n.op_type == "GroupQueryAttention" for n in graph.graph.node) == 3
    assert {p.key: p.value for p in graph.metadata_props}["qvld.kv_cache"] == "in-place"


@pytest.mark.slow
def test_daemon_serves_on_onnxruntime(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path, args=["--set", "model.backend=onnxruntime"]).start()
    try:
        case = CASES["image_photo"]
        with daemon.client() as client:
            status = client.status()
            assert status["model"]["runtime"]["BACKEND"].startswith("onnxruntime")
            result = client.generate({"messages": with_image_bytes(case["messages"], TINY),
                                      "max_tokens": case["max_new_tokens"], "temperature": 0})
            assert result["token_ids"] == case["token_ids"]
            # A bad image is refused with a typed error; the daemon serves on.
            bad = {"messages": [{"role": "user", "content": [
                {"type": "image", "image": b"not an image"}, {"type": "text", "text": "?"}]}]}
            with pytest.raises(QvlError, match="image"):
                client.generate(bad)
            again = client.generate({"messages": with_image_bytes(case["messages"], TINY),
                                     "max_tokens": case["max_new_tokens"], "temperature": 0})
            assert again["token_ids"] == case["token_ids"]
        metrics = daemon.qvlctl("metrics").stdout.decode()
        assert 'backend="onnxruntime"' in metrics
    finally:
        assert daemon.stop() == 0, daemon.log()
