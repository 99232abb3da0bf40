"""The step scheduler on the real tiny model: fair admission between users, preemption
that levels shares at every step and never changes a token, waiting sequences that
leave at once, and one reader of the KV budget."""

from __future__ import annotations

import time
from typing import Any

import pytest

from qvld.engine import Engine, GenerateRequest
from qvld.engine.runners import Generation
from qvld.errors import BadRequest, Busy
from tests.conftest import TINY, StepGate, load_reference, parity_config, wait_for, with_image_bytes

CASES = {c["name"]: c for c in load_reference(TINY)["cases"]}
ALICE, BOB = 1001, 1002


def ask(tokens: int, case: str = "question", **kw: Any) -> GenerateRequest:
    return GenerateRequest(messages=with_image_bytes(CASES[case]["messages"], TINY),
                           max_tokens=tokens, ignore_eos=True, **{"temperature": 0.0, **kw})


def submit(engine: Engine, request: GenerateRequest, uid: int) -> Generation:
    return engine.submit(engine.prepare(request, uid))


@pytest.fixture(scope="module")
def alone() -> Engine:
    """Reference answers: one generation at a time."""
    return Engine(parity_config(TINY, infer_requests=1, max_sequences=1))


def test_a_waiting_user_preempts_the_one_holding_every_place_and_no_token_changes(
        alone: Engine) -> None:
    engine = Engine(parity_config(TINY, infer_requests=2, max_sequences=2, prefill_chunk=16))
    assert engine.batch is not None
    scheduler = engine.batch.scheduler
    long_greedy = ask(400, "image_photo")
    long_sampled = ask(400, temperature=1.0, seed=7)
    with StepGate(engine) as gate:
        alices = gate.start_together([lambda: submit(engine, long_greedy, ALICE),
                                      lambda: submit(engine, long_sampled, ALICE)])
        # Bob arrives between two steps, however slow his prepare.
        assert scheduler.counts() == (2, 0)
        bob = submit(engine, ask(8, "image_gray"), BOB)
        # In the scheduler's queue, his image encoded: the place must come from alice.
        wait_for(lambda: scheduler.counts() == (2, 1), 30, "bob's to wait for a place")
    answer = bob.future.result(60)
    # Bob got a place at once: one of alice's gave it up, then resumed.
    assert scheduler.preemptions >= 1
    assert any(g.seq is not None and g.seq.preemptions for g in alices)
    assert not all(g.future.done() for g in alices), "bob waited for alice to finish"
    results = [g.future.result(120) for g in alices]
    # Every token id is what the same request gets alone, sampled ones included.
    assert answer.token_ids == alone.generate(ask(8, "image_gray")).token_ids
    assert results[0].token_ids == alone.generate(long_greedy).token_ids
    assert results[1].token_ids == alone.generate(long_sampled).token_ids
    assert answer.timings.queue_s < 5 and results[0].usage.completion_tokens == 400
    assert engine.blocks is not None and engine.blocks.stats()["held"] == 0


def test_equal_users_take_turns_whoever_came_first(alone: Engine) -> None:
    """One place: alice's three requests queue first; bob's, sent after, runs second."""
    engine = Engine(parity_config(TINY, infer_requests=1, max_sequences=1))
    assert engine.batch is not None
    scheduler = engine.batch.scheduler
    with StepGate(engine) as gate:  # the others arrive while alice's first runs
        first = submit(engine, ask(40), ALICE)
        gate.hold_when(lambda: first.seq is not None and first.seq.admitted is not None,
                       what="alice's first to run")
        later = [submit(engine, ask(20), ALICE) for _ in range(2)]
        wait_for(lambda: scheduler.counts() == (1, 2), 30, "alice's others to wait")
        bob = submit(engine, ask(20), BOB)
        wait_for(lambda: scheduler.counts() == (1, 3), 30, "bob's to wait")
        assert not first.future.done()
    bob.future.result(60)
    for gen in later:
        gen.future.result(60)
    assert bob.seq is not None and bob.seq.admitted is not None
    assert all(g.seq is not None and g.seq.admitted is not None
               and g.seq.admitted > bob.seq.admitted for g in later)
    assert engine.batch is not None and engine.batch.scheduler.preemptions == 0  # one place


def test_a_waiting_generation_leaves_at_once_when_cancelled() -> None:
    engine = Engine(parity_config(TINY, infer_requests=1, max_sequences=1))
    with StepGate(engine) as gate:  # no step runs while bob's is cancelled
        assert engine.batch is not None
        scheduler = engine.batch.scheduler
        running = submit(engine, ask(400), ALICE)
        gate.hold_when(lambda: running.seq is not None and running.seq.admitted is not None,
                       what="alice's to run")
        waiting = submit(engine, ask(400), BOB)
        wait_for(lambda: scheduler.counts() == (1, 1), 30, "bob's to wait for a place")
        assert engine.counts() == (1, 1)
        assert [running.stage, waiting.stage] == ["running", "waiting"]  # status shows
        t0 = time.monotonic()
        engine.cancel(waiting)
        result = waiting.future.result(5)
        assert result.finish_reason == "cancelled" and time.monotonic() - t0 < 1
        assert not running.future.done()
        engine.cancel(running)
    assert running.future.result(10).finish_reason == "cancelled"
    assert engine.counts() == (0, 0) and engine.generations() == []
    assert engine.blocks is not None and engine.blocks.stats()["held"] == 0


def test_the_queue_bound_and_a_request_larger_than_the_kv_cache() -> None:
    config = parity_config(TINY, infer_requests=1, max_sequences=1, kv_cache_mb=1,
                           max_new_tokens=4000)
    engine = Engine(config.model_copy(update={
        "server": config.server.model_copy(update={"queue_max": 1})}))
    running = submit(engine, ask(300), ALICE)
    waiting = submit(engine, ask(300), ALICE)
    with pytest.raises(Busy, match="queue is full"):
        submit(engine, ask(4), BOB)
    engine.cancel(waiting)
    engine.cancel(running)
    for gen in (running, waiting):
        gen.future.result(10)
    assert engine.blocks is not None
    rows = engine.blocks.num_blocks * engine.blocks.block_size
    assert rows < 3000  # 1 MiB of the tiny model's KV cache
    with pytest.raises(BadRequest, match=r"engine\.kv_cache_mb"):
        engine.generate(GenerateRequest(messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=rows + 1))
    assert engine.generate(ask(4)).usage.completion_tokens == 4  # still serving
