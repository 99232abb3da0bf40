"""A user's answer does not depend on who else is decoding: on int8 ONNX Runtime graphs
of the tiny model (the recommended layout on AVX2 CPUs), user A's greedy token ids and
top-5 logprobs are the same bits alone and while two other users decode beside it, in
the decode lane and with A's prompt prefilled in chunks between their steps.

The graphs quantise each token's activations with its own scale
(``modeltools/onnx_int8``). The control: onnxruntime's ``quantize_dynamic`` graphs (one
scale per tensor, what qvld exported before), run by the same engine, fail the same
comparison.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest
from qvld.engine.model.model_dir import SUBMODELS, onnx_path
from qvld.engine.runners import Generation
from qvld.modeltools.onnx_export import quantize_int8, save_graph
from tests.conftest import TINY, StepGate, wait_for

WORDS = [
    "red", "blue", "green", "cat", "dog", "sea", "sky", "tree", "stone", "river", "house", "light",
    "small", "old", "new", "bright", "dark", "fast", "slow", "cold", "warm", "city", "field",
    "road",
]


def prompt(rng: np.random.Generator, words: int) -> list[dict[str, Any]]:
    text = " ".join(rng.choice(WORDS, words))
    return [{"role": "user", "content": [{"type": "text", "text": f"Tell me about {text}."}]}]


def request(messages: list[dict[str, Any]], tokens: int) -> GenerateRequest:
    return GenerateRequest(messages=messages, temperature=0.0, max_tokens=tokens,
                           ignore_eos=True, logprobs=5)


def answer(gen: Generation) -> tuple[list[int], list[dict[str, Any]]]:
    result = gen.future.result(120)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    assert result.usage.cached_tokens == 0  # every prompt computed, none reused
    return result.token_ids, result.logprobs


def int8_copy(root: Path, name: str, quantise: Callable[[Path], None]) -> Path:
    model = root / name
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("openvino_*"))
    quantise(model)
    return model


def per_tensor(model: Path) -> None:
    """onnxruntime's own dynamic quantisation (one activation scale per tensor), saved
    with the metadata of ours so that the engine runs it: the control."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for submodel in SUBMODELS:
        path = onnx_path(model, submodel)
        theirs = path.with_name("theirs.onnx")
        quantize_dynamic(path, theirs, weight_type=QuantType.QInt8, per_channel=True,
                         reduce_range=True, op_types_to_quantize=["MatMul", "Gemm"])
        save_graph(theirs, path, "int8")
        theirs.unlink()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("int8")
    yield {"per-row": int8_copy(root, "per-row", quantize_int8),
           "per-tensor": int8_copy(root, "per-tensor", per_tensor)}


def engine_on(model: Path) -> Engine:
    # Chunks of 16 prompt rows; three running sequences, their one-row steps in the lane.
    return Engine(Config(model=ModelConfig(path=model, backend="onnxruntime"),
                         engine=EngineConfig(infer_requests=3, max_sequences=3,
                                             prefill_chunk=16)))


class Steps:
    """What each step of the loop fed: (running sequences, prompt rows)."""

    def __init__(self, engine: Engine) -> None:
        assert engine.batch is not None
        self.seen: list[tuple[int, int]] = []
        self.previous = engine.batch.on_step
        engine.batch.on_step = self.record

    def record(self, sequences: int, prefill_rows: int) -> None:
        self.seen.append((sequences, prefill_rows))
        if self.previous is not None:
            self.previous(sequences, prefill_rows)


def beside_others(engine: Engine, mine: GenerateRequest, seed: int, late: bool
                  ) -> tuple[list[int], list[dict[str, Any]]]:
    """A's answer while users 1 and 2 decode other prompts. ``late``: A arrives once
    theirs decode, its prompt prefilled in chunks between their steps; else the three
    start together and decode side by side in the lane."""
    rng = np.random.default_rng(100 + seed)
    others = [request(prompt(rng, 6 + 5 * i), 40) for i in range(2)]

    def start(req: GenerateRequest, uid: int) -> Callable[[], Generation]:
        return lambda: engine.submit(engine.prepare(req, uid))

    theirs_uid = 2000 + 10 * seed + 2 * late
    their_starts = [start(r, uid) for uid, r in enumerate(others, theirs_uid)]

    # A's uid differs from its other runs': prefix caches are per user, so its prompt is
    # computed again, not taken from the blocks those runs left.
    a_uid = 1000 + 10 * seed + late
    with StepGate(engine) as gate:
        if late:
            theirs = gate.start_together(their_starts, tokens=2)
            steps = Steps(engine)
            gen = start(mine, a_uid)()  # arrives while the loop is held
            wait_for(lambda: gen.seq is not None and any(
                q is gen.seq for q in engine.batch.view[1]), 60, "A to wait for a place")
            gate.release()
            got = answer(gen)
            # A's prompt went in over several steps, each beside the others' rows.
            prompt_steps = [s for s in steps.seen if s[1] > 0]
            assert len(prompt_steps) >= 2 and all(n >= 3 for n, _ in prompt_steps), steps.seen
        else:
            gens = gate.start_together([start(mine, a_uid), *their_starts], tokens=2)
            theirs = gens[1:]
            gate.release()
            got = answer(gens[0])
    for gen in theirs:
        answer(gen)
    return got


def differences(engine: Engine, seeds: range) -> list[str]:
    """Where A's answer beside others differs from A's answer alone, for each seed and
    both ways of meeting them."""
    found = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        mine = request(prompt(rng, 40), 12)  # 50+ prompt rows: 4 chunks of 16
        alone = answer(engine.submit(engine.prepare(mine, 500 + seed)))
        for late in (False, True):
            ids, logprobs = beside_others(engine, mine, seed, late)
            where = f"seed {seed}, {'prefilled beside' if late else 'lane'}"
            if ids != alone[0]:
                found.append(f"{where}: ids {ids} != {alone[0]}")
            elif logprobs != alone[1]:
                found.append(f"{where}: logprobs moved")
    return found


def test_an_answer_beside_others_is_the_answer_alone(models: dict[str, Path]) -> None:
    engine = engine_on(models["per-row"])
    assert engine.stats()["batch"]["continuous_batching"] is True
    assert engine.models.runtime_properties["WEIGHTS"] == "int8"
    assert differences(engine, range(3)) == []
    assert engine.batch.peak_sequences == 3
    assert engine.blocks.stats()["held"] == 0


def test_with_one_scale_per_tensor_others_move_the_answer(models: dict[str, Path]) -> None:
    # The same comparison on the graphs qvld exported before: it catches them.
    assert differences(engine_on(models["per-tensor"]), range(1)) != []
