"""Continuous batching on the real tiny model: every sequence's ids are the same whether
it runs alone or packed with others of different lengths, images and start times (and
equal transformers'); one sequence's end (stop, cancel, error) never disturbs the
others; blocks come back; the prefix cache works on whole blocks."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from qvld.engine import Engine, GenerateRequest, GenerateResult
from tests.conftest import TINY, load_reference, parity_config, wait_for, with_image_bytes

REFERENCE = load_reference(TINY)
CASES = {c["name"]: c for c in REFERENCE["cases"]}


def request(case: dict[str, Any], **kw: Any) -> GenerateRequest:
    return GenerateRequest(messages=with_image_bytes(case["messages"], TINY),
                           max_tokens=case["max_new_tokens"], temperature=0.0, **kw)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(parity_config(TINY, infer_requests=6, prefill_chunk=48, max_batch_tokens=96))


def held(engine: Engine) -> int:
    assert engine.blocks is not None
    return engine.blocks.stats()["held"]


def test_concurrent_sequences_equal_transformers(engine: Engine) -> None:
    cases = list(CASES.values())
    assert engine.batch is not None
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda c: engine.generate(request(c)), cases))
    for case, result in zip(cases, results, strict=True):
        assert result.token_ids == case["token_ids"], case["name"]
    assert engine.batch.peak_sequences >= 4  # they really ran together
    assert held(engine) == 0


def test_sessions_run_batched_and_reuse_their_history_blocks(engine: Engine) -> None:
    sessions = REFERENCE["sessions"]

    def converse(session: dict[str, Any]) -> list[GenerateResult]:
        return [engine.generate(request(turn, session=f"b-{session['name']}"), uid=7)
                for turn in session["turns"]]

    with ThreadPoolExecutor(len(sessions)) as pool:
        conversations = list(pool.map(converse, sessions))
    reused = 0
    for session, results in zip(sessions, conversations, strict=True):
        for turn, result in zip(session["turns"], results, strict=True):
            assert result.token_ids == turn["token_ids"], session["name"]
        reused += sum(r.usage.cached_tokens for r in results[1:])
    assert reused > 0


def test_a_shared_prefix_is_reused_in_whole_blocks(engine: Engine) -> None:
    case = CASES["long"]
    assert engine.blocks is not None
    size = engine.blocks.block_size
    first = engine.generate(request(case), uid=11)
    again = engine.generate(request(case), uid=11)
    other = engine.generate(request(case), uid=12)  # another user: never someone's prefix
    n = len(case["input_ids"])
    assert first.token_ids == again.token_ids == other.token_ids == case["token_ids"]
    assert again.usage.cached_tokens == (n - 1) // size * size > 0
    assert other.usage.cached_tokens == 0


def test_a_cancelled_or_failing_sequence_leaves_the_others_exact(engine: Engine) -> None:
    cancel = threading.Event()
    failing_started = threading.Event()
    keep, victim, bad = CASES["long"], CASES["image_photo"], CASES["question"]

    def explode(text: str, ids: list[int]) -> None:
        failing_started.set()
        raise RuntimeError("the client's stream broke")

    with ThreadPoolExecutor(3) as pool:
        kept = pool.submit(engine.generate, request(keep))
        # Long enough never to finish before the cancel (its case's few tokens could).
        long_victim = GenerateRequest(messages=with_image_bytes(victim["messages"], TINY),
                                      max_tokens=400, temperature=0.0, ignore_eos=True)
        cancelled = pool.submit(engine.generate, long_victim, None, 0, cancel.is_set)
        failed = pool.submit(engine.generate, request(bad), explode)
        wait_for(failing_started.is_set, what="the failing sequence streamed")
        cancel.set()
        assert kept.result().token_ids == keep["token_ids"]
        assert cancelled.result().finish_reason == "cancelled"
        with pytest.raises(RuntimeError, match="stream broke"):
            failed.result()
    assert engine.generate(request(bad)).token_ids == bad["token_ids"]
    assert held(engine) == 0


def test_without_a_kv_budget_nothing_is_retained() -> None:
    case = CASES["long"]
    plain = Engine(parity_config(TINY, infer_requests=2, kv_cache_mb=0))
    assert plain.blocks is not None
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: plain.generate(request(case)), range(2)))
    assert all(r.token_ids == case["token_ids"] for r in results)
    assert all(r.usage.cached_tokens == 0 for r in results)
    assert plain.blocks.stats()["cached"] == 0
    assert held(plain) == 0


# The unpinned run is the control (the same traffic evicts the history): slow tier.
@pytest.mark.parametrize("pins", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["pinned", "unpinned"])
def test_a_sessions_history_blocks_stay_pinned_through_other_traffic(pins: bool) -> None:
    # A small cache (1 MiB: 23 blocks of 32 rows on the tiny model): the other requests
    # below cycle through every unpinned block.
    small = Engine(parity_config(TINY, infer_requests=2, kv_cache_mb=1))
    assert small.blocks is not None
    if not pins:  # the same traffic evicts the whole history
        small.blocks.max_pinned = 0
    first = small.generate(request(CASES["long"], session="kept"))
    history = first.usage.prompt_tokens + first.usage.completion_tokens
    pinned = small.blocks.stats()["pinned"] * small.blocks.block_size
    assert pinned == (history // 32 * 32 if pins else 0)
    for case in CASES.values():  # without the pin, this evicts the whole history
        if case["name"] != "long":
            small.generate(request(case))
    follow_up = small.generate(GenerateRequest(
        messages=[{"role": "user", "content": "And then?"}], max_tokens=4,
        temperature=0.0, session="kept"))
    if not pins:
        assert follow_up.usage.cached_tokens == 0
        return
    assert follow_up.usage.cached_tokens == (history - 1) // 32 * 32 > 0
    pinned = small.blocks.stats()["pinned"]
    assert small.stats() == small.stats()  # reading the stats changes nothing
    assert small.blocks.stats()["pinned"] == pinned > 0
    assert small.sessions.close(0, "kept")  # the session goes: its pin with it, at once
    assert small.blocks.stats()["pinned"] == 0


def test_one_image_asked_about_at_once_is_encoded_once() -> None:
    fresh = Engine(parity_config(TINY, infer_requests=4))
    photo = CASES["image_photo"]
    barrier = threading.Barrier(4)

    def ask(question: str) -> GenerateResult:
        messages = with_image_bytes(photo["messages"], TINY)
        image = next(p for p in messages[-1]["content"] if p["type"] == "image")
        barrier.wait()
        return fresh.generate(GenerateRequest(messages=[{"role": "user", "content": [
            image, {"type": "text", "text": question}]}], max_tokens=2, temperature=0.0))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(ask, ["What?", "Where?", "Why?", "Who?"]))
    assert sum(r.image_cache_misses for r in results) == 1
    assert sum(r.image_cache_hits for r in results) == 3
