"""Prefix KV cache, image-embedding cache and sessions: exact, and actually reused."""

from __future__ import annotations

from typing import Any

import pytest

from qvld.engine import Engine, GenerateRequest
from qvld.errors import Busy
from tests.conftest import TINY, load_reference, parity_config, reused, with_image_bytes

REFERENCE = load_reference(TINY)
CASES = {c["name"]: c for c in REFERENCE["cases"]}
SESSIONS = REFERENCE["sessions"]


def ask(engine: Engine, case: dict[str, Any], **kw: Any) -> Any:
    # Who asks and when to stop are the engine's arguments; the rest is the request.
    run = {key: kw.pop(key) for key in ("uid", "should_stop") if key in kw}
    return engine.generate(GenerateRequest(
        messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
        max_tokens=case["max_new_tokens"], **kw), **run)


@pytest.mark.parametrize("session", SESSIONS, ids=[s["name"] for s in SESSIONS])
def test_session_turns_equal_transformers_on_the_exact_sequence(session: dict[str, Any]
                                                                ) -> None:
    engine = Engine(parity_config(TINY, infer_requests=2))
    for n, turn in enumerate(session["turns"]):
        result = ask(engine, turn, session="s")
        assert result.token_ids == turn["token_ids"], f"turn {n}"
        assert result.usage.prompt_tokens == len(turn["input_ids"])
        if n:  # the history (all but the last generated token) came from the KV cache
            before = session["turns"][n - 1]
            fed = len(before["input_ids"]) + len(before["token_ids"]) - 1  # rows in KV
            expected = reused(engine, min(fed, len(turn["input_ids"]) - 1))
            assert result.usage.cached_tokens == expected
    stored, _ = engine.sessions.lookup(0, "s")
    assert stored is not None
    last = session["turns"][-1]
    assert stored.ids == last["input_ids"] + last["token_ids"]


def test_session_turns_are_exact_without_any_cache() -> None:
    engine = Engine(parity_config(TINY, infer_requests=1, kv_cache_mb=0, image_cache_mb=0))
    for session in SESSIONS:
        for turn in session["turns"]:
            result = ask(engine, turn, session=session["name"])
            assert result.token_ids == turn["token_ids"]
            assert result.usage.cached_tokens == 0
    assert engine.images.stats()["entries"] == 0


def test_same_ids_with_and_without_caches_in_a_reusing_order() -> None:
    cached = Engine(parity_config(TINY, infer_requests=2))
    plain = Engine(parity_config(TINY, infer_requests=1, kv_cache_mb=0, image_cache_mb=0))
    order = ["image_photo", "image_photo", "two_images_one_message", "image_gray",
             "system", "image_with_system", "system", "image_jpeg", "long", "long",
             "images_in_two_turns", "image_small"]
    reused = 0
    for name in order:
        case = CASES[name]
        a, b = ask(cached, case), ask(plain, case)
        assert a.token_ids == b.token_ids == case["token_ids"], name
        assert b.usage.cached_tokens == 0
        reused += a.usage.cached_tokens
    assert reused > 0
    stats = cached.images.stats()
    assert stats["hits"] > 0 and stats["entries"] > 0


def test_a_repeated_image_skips_decoding_and_encoding() -> None:
    # No KV reuse here, so that the image-embedding cache alone is at work.
    engine = Engine(parity_config(TINY, infer_requests=1, kv_cache_mb=0))
    ask(engine, CASES["image_photo"])
    question = {"messages": [{"role": "user", "content": [
        {"type": "image", "image": "photo.png"}, {"type": "text", "text": "Other question"}]}],
        "max_new_tokens": 4}
    prepared = engine.prepare(GenerateRequest(messages=with_image_bytes(
        question["messages"], TINY)))
    assert prepared.images[0].patches is None  # the cache told its grid: no decoding
    hits, misses = engine.images.hits, engine.images.misses
    result = engine.run(prepared)
    assert (engine.images.hits, engine.images.misses) == (hits + 1, misses)
    assert result.usage.cached_tokens == 0 and result.usage.image_tokens == 54


@pytest.mark.parametrize("batching", [True, False], ids=["paged", "slots"])
def test_a_prefix_shared_in_whole_blocks_is_reused_exactly(batching: bool) -> None:
    # The same 131-row prompt again: its rows are cached in whole blocks (all but the
    # last row, whose logits give the first token), whichever executor steps (a slot's
    # own cache is cut back to them).
    engine = Engine(parity_config(TINY, infer_requests=1, continuous_batching=batching))
    a, b = ask(engine, CASES["long"]), ask(engine, CASES["long"])
    size = engine.blocks.block_size
    assert a.usage.cached_tokens == 0 and b.usage.cached_tokens == 130 // size * size
    assert a.token_ids == b.token_ids == CASES["long"]["token_ids"]


def test_sessions_are_per_uid_and_one_never_sees_anothers() -> None:
    engine = Engine(parity_config(TINY, infer_requests=1))
    first, second = SESSIONS[0]["turns"][:2]
    ask(engine, first, session="mine", uid=1000)
    # The same id is another user's own, fresh session: no error, no trace of the first.
    other = ask(engine, first, session="mine", uid=1001)
    assert other.session is not None and (other.session.turns, other.session.reset) == (1, False)
    assert other.token_ids == first["token_ids"]
    assert [(s["id"], s["uid"]) for s in engine.sessions.list(1001)] == [("mine", 1001)]
    assert not engine.sessions.close(1001, "nothing-here")
    assert engine.sessions.close(1001, "mine")
    # uid 1000's session went on untouched.
    assert ask(engine, second, session="mine", uid=1000).token_ids == second["token_ids"]
    assert [s["turns"] for s in engine.sessions.list(1000)] == [2]


def test_session_limits_and_concurrency() -> None:
    engine = Engine(parity_config(TINY, infer_requests=1, sessions_max=2, session_ttl_s=60))
    turn = SESSIONS[0]["turns"][0]
    for sid in ("a", "b", "c"):
        ask(engine, turn, session=sid)
    assert sorted(s["id"] for s in engine.sessions.list(None)) == ["b", "c"]  # LRU out
    prepared = engine.prepare(GenerateRequest(messages=turn["messages"], session="b",
                                              max_tokens=2))
    stale = engine.prepare(GenerateRequest(messages=turn["messages"], session="b",
                                           max_tokens=2))
    engine.run(prepared)
    with pytest.raises(Busy, match="moved on"):
        engine.run(stale)


def test_image_pad_ids_in_a_session_history_are_text() -> None:
    # A model may generate the image-pad id; it must not be taken for an image later.
    engine = Engine(parity_config(TINY, infer_requests=1))
    pad = engine.spec.image_token_id
    ids, _, _ = engine.tokenize(GenerateRequest(messages=[{"role": "user", "content": "Hi"}]))
    turn = engine.sessions.begin(0, "x", None, 0)
    engine.sessions.commit(turn, [*ids, pad, pad, 5], [], [])
    engine.sessions.end(turn)
    result = engine.generate(GenerateRequest(messages=[{"role": "user", "content": "More"}],
                                             session="x", max_tokens=3, temperature=0.0))
    assert len(result.token_ids) == 3
    image = SESSIONS[2]["turns"][0]
    result = ask(engine, image, session="x")  # an image after the stray pads
    assert result.usage.image_tokens == 6 and len(result.token_ids) == 10
