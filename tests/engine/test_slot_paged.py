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


NAMES = ["long", "image_photo", "question"]


def answers_side_by_side(engine: Engine) -> list[list[int]]:
    """NAMES' answers, generated side by side however loaded the machine."""
    def start(name: str) -> Callable[[], Generation]:
        case = CASES[name]
        return lambda: engine.submit(engine.prepare(GenerateRequest(
            messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
            max_tokens=case["max_new_tokens"])))

    with StepGate(engine) as gate:
        gens = gate.start_together([start(name) for name in NAMES], tokens=2)
    return [gen.future.result(60).token_ids for gen in gens]


@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_more_running_sequences_than_slots_load_from_their_blocks_and_stay_exact(
        runtime: str) -> None:
    # One slot, three sequences in every step: each step loads each sequence's rows
    # from its blocks into the slot, and every answer is still transformers' own.
    engine = engine_on(runtime, infer_requests=1, max_sequences=3)
    model = engine.batch.model
    assert isinstance(model, SlotPaged)
    assert engine.stats()["batch"]["continuous_batching"] is (runtime == "onnxruntime")
    assert answers_side_by_side(engine) == [CASES[name]["token_ids"] for name in NAMES]
    # ONNX Runtime decodes all three in its lane; OpenVINO's stateful slots take turns.
    moved = model.lane_loads if runtime == "onnxruntime" else model.reloads
    assert moved > 0 and engine.batch.peak_sequences == 3
    assert engine.blocks.stats()["held"] == 0


def test_a_slot_whose_blocks_were_written_since_loads_them_again() -> None:
    # A slot's cache mirrors blocks at the versions it saw. Once one of those blocks is
    # written (it went to another sequence), the next step of a sequence with that
    # block table loads the blocks again rather than trust the slot: the blocks are the
    # truth. (Slots only, no decode lane: one-row steps stay on the slot.)
    engine = engine_on("onnxruntime", infer_requests=1)
    lane_model = engine.batch.model
    assert isinstance(lane_model, SlotPaged)
    model = SlotPaged(engine.models.new_slot, 1, lane_model.num_blocks, lane_model.layout)
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


def test_the_decode_lane_steps_sequences_of_any_lengths_as_each_would_step_alone() -> None:
    # The lane runs every one-row step in one inference, the sequences' caches side by
    # side, each at its own length. Each sequence's logits (to the bit) and KV rows are
    # what a slot of its own computes; the lane is filled from the blocks only when
    # the set of sequences changes, not when they come in another order.
    engine = engine_on("onnxruntime", infer_requests=1)
    model = engine.batch.model
    assert isinstance(model, SlotPaged)
    alone = SlotPaged(engine.models.new_slot, 1, model.num_blocks, model.layout)
    rng = np.random.default_rng(1)
    hidden = engine.spec.hidden_size
    tables = {"a": np.array([1, 2], np.int32), "b": np.array([4], np.int32),
              "c": np.array([6, 7], np.int32)}
    lengths = {"a": BLOCK_ROWS + 5, "b": 3, "c": BLOCK_ROWS - 1}

    def step(paged: SlotPaged, names: list[str], rows: list[np.ndarray]) -> np.ndarray:
        counts = [len(r) for r in rows]
        begins = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        positions = np.concatenate(
            [np.broadcast_to(np.arange(lengths[n], lengths[n] + k), (3, k))
             for n, k in zip(names, counts, strict=True)], 1)
        table = np.concatenate([tables[n] for n in names])
        block_begins = np.concatenate([[0], np.cumsum([len(tables[n]) for n in names])])
        return paged.step(np.concatenate(rows), positions, np.zeros(sum(counts), bool),
                          paged.no_deepstack(), np.array([lengths[n] for n in names], np.int32),
                          begins, block_begins.astype(np.int32), table)

    def both(names: list[str], rows: list[np.ndarray]) -> np.ndarray:
        # The same rows stepped on the lane (all at once) and each alone on a slot.
        together = step(model, names, rows)
        apart = np.concatenate([step(alone, [n], [r]) for n, r in zip(names, rows, strict=True)])
        np.testing.assert_array_equal(together, apart)  # exact: every row on its own
        for n, r in zip(names, rows, strict=True):
            lengths[n] += len(r)
        return together

    prompts = {n: rng.standard_normal((lengths[n], hidden)).astype(np.float32) for n in tables}
    for n in tables:  # prompts: many rows, on slots
        lengths[n] = 0
        both([n], [prompts[n]])
    assert model.lane_loads == 0

    def one_row(names: list[str]) -> list[np.ndarray]:
        return [rng.standard_normal((1, hidden)).astype(np.float32) for _ in names]

    both(["a", "b", "c"], one_row(["a", "b", "c"]))
    assert model.lane_loads == 1
    both(["c", "a", "b"], one_row(["c", "a", "b"]))  # another order: the same lane
    both(["a", "b", "c"], one_row(["a", "b", "c"]))
    assert model.lane_loads == 1
    both(["a", "c"], one_row(["a", "c"]))  # b finished: refilled without it
    assert model.lane_loads == 2
    both(["a", "c"], one_row(["a", "c"]))
    assert model.lane_loads == 2
    # What the lane wrote to the blocks is what the slot wrote to its own.
    for n in ("a", "c"):
        np.testing.assert_allclose(model.read_rows(tables[n], lengths[n])[5],
                                   alone.read_rows(tables[n], lengths[n])[5],
                                   rtol=1e-4, atol=1e-4)
    # A block written behind the lane's back (its rows went to another sequence) makes
    # the lane load again rather than trust its copy.
    model.write_rows(tables["a"], 0, [r[:, :, :1] for r in model.read_rows(tables["a"], 1)])
    step(model, ["a", "c"], one_row(["a", "c"]))
    assert model.lane_loads == 3
