"""The slot executor (``model/slot_paged.py``): a runtime without paged attention in the
step loop over the same KV blocks, on real ONNX Runtime and OpenVINO (stateful) slots of
the tiny model. Exactness under preemption is in test_scheduler (every executor), the
reference cases in test_onnxruntime and test_reuse."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from qvld.engine import Engine, GenerateRequest
from qvld.engine.model.slot_paged import BLOCK_ROWS, SlotPaged
from qvld.engine.runners import Generation
from tests.conftest import TINY, StepGate, load_reference, parity_config, with_image_bytes

CASES = {c["name"]: c for c in load_reference(TINY)["cases"]}
RUNTIMES = {"onnxruntime": ("onnxruntime", {}),
            "openvino-stateful": ("openvino", {"continuous_batching": False})}


def engine_on(runtime: str, **engine: Any) -> Engine:
    backend, settings = RUNTIMES[runtime]
    return Engine(parity_config(TINY, backend, **{**settings, **engine}))


def ask(engine: Engine, name: str) -> list[int]:
    case = CASES[name]
    return engine.generate(GenerateRequest(
        messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
        max_tokens=case["max_new_tokens"])).token_ids


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_more_running_sequences_than_slots_load_from_their_blocks_and_stay_exact(
        runtime: str) -> None:
    # One slot, three sequences in every step: each step loads each sequence's rows
    # from its blocks into the slot, and every answer is still transformers' own.
    engine = engine_on(runtime, infer_requests=1, max_sequences=3)
    model = engine.batch.model
    assert isinstance(model, SlotPaged) and engine.stats()["batch"]["continuous_batching"] is False
    names = ["long", "image_photo", "question"]

    def start(name: str) -> Callable[[], Generation]:
        case = CASES[name]
        return lambda: engine.submit(engine.prepare(GenerateRequest(
            messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
            max_tokens=case["max_new_tokens"])))

    with StepGate(engine) as gate:  # side by side however loaded the machine
        gens = gate.start_together([start(name) for name in names], tokens=2)
    answers = [gen.future.result(60).token_ids for gen in gens]
    assert answers == [CASES[name]["token_ids"] for name in names]
    assert model.reloads > 0 and engine.batch.peak_sequences == 3
    assert engine.blocks.stats()["held"] == 0


def test_a_slot_whose_blocks_were_written_since_loads_them_again() -> None:
    # A slot's cache mirrors blocks at the versions it saw. Once one of those blocks is
    # written (it went to another sequence), the next step of a sequence with that
    # block table loads the blocks again rather than trust the slot: the blocks are the
    # truth.
    engine = engine_on("onnxruntime", infer_requests=1)
    model = engine.batch.model
    assert isinstance(model, SlotPaged)
    rng = np.random.default_rng(0)
    hidden = engine.spec.hidden_size
    rows = BLOCK_ROWS + 8
    table = np.array([3, 5], np.int32)

    def step(count: int, past: int) -> np.ndarray:
        embeds = rng.standard_normal((count, hidden)).astype(np.float32)
        positions = np.broadcast_to(np.arange(past, past + count), (3, count)).copy()
        return model.step(embeds, positions, np.zeros(count, bool), model.no_deepstack(),
                          np.array([past], np.int32), np.array([0, count], np.int32),
                          np.array([0, len(table)], np.int32), table)

    step(rows, 0)
    written = model.read_rows(table, rows)
    assert written[0].shape == (1, engine.spec.num_kv_heads, rows, engine.spec.head_dim)
    assert np.abs(written[0]).sum() > 0  # the step's rows went to the blocks
    step(1, rows)
    assert model.reloads == 0  # the slot held them
    model.write_rows(table, BLOCK_ROWS, [np.zeros((1, a.shape[1], 1, a.shape[3]), np.float32)
                                         for a in written])
    step(1, rows + 1)
    assert model.reloads == 1
    again = model.read_rows(table, rows + 2)
    assert np.array_equal(again[0][:, :, :BLOCK_ROWS], written[0][:, :, :BLOCK_ROWS])
    assert not np.any(again[0][:, :, BLOCK_ROWS])  # what was written stayed written
