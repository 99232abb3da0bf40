"""``n`` > 1: choices of one prompt share its prefill and its KV blocks, each sampled on
its own (seed + index), on the committed tiny model."""

from __future__ import annotations

from typing import Any

import pytest

from qvld.engine import Engine, GenerateRequest
from qvld.engine.inputs.request import parse_generate
from qvld.errors import BadRequest
from tests.conftest import TINY, load_reference, parity_config, with_image_bytes

CASE = next(c for c in load_reference(TINY)["cases"] if c["name"] == "image_photo")
MESSAGES = with_image_bytes(CASE["messages"], TINY)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(parity_config(TINY, prefill_chunk=64))


def sampled(**kw: Any) -> GenerateRequest:
    return GenerateRequest(messages=MESSAGES, max_tokens=16, temperature=1.0, seed=7, **kw)


def test_choices_share_one_prefill_and_sample_on_their_own(engine: Engine) -> None:
    assert engine.batch is not None and engine.blocks is not None
    block = engine.blocks.block_size
    engine.blocks.clear()
    fed: list[int] = []
    engine.batch.on_prefill = lambda runtime, rows: fed.append(rows)
    try:
        prepared = engine.prepare(sampled(n=3))
        results = [g.future.result(60) for g in engine.submit_choices(prepared, [None] * 3)]
    finally:
        engine.batch.on_prefill = None
    prompt = len(prepared.ids)
    shared = prompt // block * block
    assert shared > 0
    # The prompt once; each other choice only the rows of its last, partly filled block.
    assert sum(fed) == prompt + 2 * (prompt - shared)
    assert [r.usage.cached_tokens for r in results] == [0, shared, shared]
    assert sum(r.image_cache_misses for r in results) == 1  # the image encoded once
    for i, result in enumerate(results):  # choice i is the request with seed + i
        alone = engine.generate(GenerateRequest(messages=MESSAGES, max_tokens=16,
                                                temperature=1.0, seed=7 + i))
        assert result.token_ids == alone.token_ids
    assert len({tuple(r.token_ids) for r in results}) > 1


def test_greedy_choices_are_equal(engine: Engine) -> None:
    prepared = engine.prepare(GenerateRequest(messages=MESSAGES, max_tokens=8,
                                              temperature=0.0, n=2))
    first, second = (g.future.result(60) for g in engine.submit_choices(prepared,
                                                                       [None, None]))
    assert first.token_ids == second.token_ids == CASE["token_ids"][:8]


def test_cancelled_choices_all_end(engine: Engine) -> None:
    prepared = engine.prepare(GenerateRequest(messages=MESSAGES, max_tokens=400,
                                              ignore_eos=True, n=4))
    gens = engine.submit_choices(prepared, [None] * 4)
    for gen in gens:  # the others wait for the first's prefill: they end unstarted
        engine.cancel(gen)
    results = [g.future.result(30) for g in gens]
    assert [r.finish_reason for r in results] == ["cancelled"] * 4
    assert engine.generations() == []


def test_without_continuous_batching_choices_run_side_by_side() -> None:
    slots = Engine(parity_config(TINY, continuous_batching=False))
    prepared = slots.prepare(sampled(n=2))
    results = [g.future.result(60) for g in slots.submit_choices(prepared, [None, None])]
    for i, result in enumerate(results):
        alone = slots.generate(GenerateRequest(messages=MESSAGES, max_tokens=16,
                                               temperature=1.0, seed=7 + i))
        assert result.token_ids == alone.token_ids


@pytest.mark.parametrize(("params", "message"), [
    ({"n": 0}, "n must be within"), ({"n": 17}, "n must be within"),
    ({"n": "2"}, "n must be an integer"), ({"n": 2, "session": "s"}, "session"),
])
def test_bad_n_is_a_bad_request(params: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        parse_generate({"messages": MESSAGES, **params})
