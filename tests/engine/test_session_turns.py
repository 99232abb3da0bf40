"""Session turns in the engine: a history is what the client saw (stop strings,
cancelled turns), and a lost history is started afresh and reported, never faked."""

from __future__ import annotations

from typing import Any

import pytest

from qvld.engine import Engine, GenerateRequest, GenerateResult
from qvld.engine.types import SessionInfo
from tests.conftest import TINY, load_reference, parity_config, reused, with_image_bytes

REFERENCE = load_reference(TINY)
CASES = {c["name"]: c for c in REFERENCE["cases"]}
SESSIONS = {s["name"]: s for s in REFERENCE["sessions"]}
IMAGE_SESSION = SESSIONS["session_image_follow_up"]["turns"]


def ask(engine: Engine, case: dict[str, Any], **kw: Any) -> GenerateResult:
    # Who asks and when to stop are the engine's arguments; the rest is the request.
    run = {key: kw.pop(key) for key in ("uid", "should_stop") if key in kw}
    return engine.generate(GenerateRequest(
        messages=with_image_bytes(case["messages"], TINY), temperature=0.0,
        max_tokens=case["max_new_tokens"], **kw), **run)


def history(engine: Engine, sid: str, uid: int = 0) -> list[int] | None:
    session, _ = engine.sessions.lookup(uid, sid)
    return None if session is None else session.ids


def stop_after(calls: int) -> Any:
    """A should_stop that fires on its ``calls``-th poll (the client leaves mid-turn)."""
    polls = {"n": 0}

    def should_stop() -> bool:
        polls["n"] += 1
        return polls["n"] >= calls
    return should_stop


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(parity_config(TINY, infer_requests=2))


def test_a_cancelled_or_timed_out_turn_changes_nothing(engine: Engine) -> None:
    first, second = SESSIONS["session_text"]["turns"][:2]
    # A new session whose first turn is cancelled is never created.
    result = ask(engine, first, session="c1", should_stop=stop_after(4))
    assert result.finish_reason == "cancelled"
    assert result.session == SessionInfo("c1", turns=0, reset=False)
    assert "c1" not in {s["id"] for s in engine.sessions.list(None)}
    assert engine.sessions.lookup(0, "c1") == (None, False)
    # An existing one keeps its history when a later turn is cancelled ...
    ask(engine, first, session="c2")
    before = history(engine, "c2")
    result = ask(engine, second, session="c2", should_stop=stop_after(4))
    assert result.finish_reason == "cancelled" and 0 < len(result.token_ids) < 12
    assert history(engine, "c2") == before
    assert result.session == SessionInfo("c2", turns=1, reset=False)
    # ... so the retried turn equals transformers on the exact sequence.
    retried = ask(engine, second, session="c2")
    assert retried.token_ids == second["token_ids"]
    assert retried.session == SessionInfo("c2", turns=2, reset=False)


def pieces(engine: Engine, ids: list[int]) -> list[str]:
    """The text each id adds."""
    texts = [engine.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    return [texts[k + 1][len(texts[k]):] for k in range(len(ids))]


def stop_inside_and_at_end_of_a_token(engine: Engine, ids: list[int]) -> tuple[int, str, str]:
    """A token k (2+ clean characters, after a clean one) and two stop strings that first
    occur across the boundary before it: one ending inside token k, one at its end."""
    parts = pieces(engine, ids)
    full = "".join(parts)
    for k in range(1, len(parts)):
        before, piece = parts[k - 1], parts[k]
        if len(piece) < 2 or not before or "\ufffd" in before + piece:
            continue
        start = len("".join(parts[:k]))
        inside, at_end = before[-1] + piece[0], before[-1] + piece
        if full.find(inside) == start - 1 and full.find(at_end) == start - 1:
            return k, inside, at_end
    raise AssertionError("no token fits; pick another reference case")


@pytest.mark.parametrize("batching", [True, False], ids=["batched", "slots"])
@pytest.mark.parametrize("where", ["inside", "at_end"])
def test_a_stop_string_commits_the_turn_through_the_stop(where: str, batching: bool) -> None:
    # On slots the follow-up reuses the history row by row; batched, in whole blocks
    # (none for this short history: test_batch covers block reuse by sessions).
    engine = Engine(parity_config(TINY, infer_requests=2, continuous_batching=batching))
    case = CASES["question"]
    k, inside, at_end = stop_inside_and_at_end_of_a_token(engine, case["token_ids"])
    stop = inside if where == "inside" else at_end
    sid = f"stop-{where}"
    result = ask(engine, case, session=sid, stop=[stop])
    assert result.finish_reason == "stop"
    assert result.token_ids == case["token_ids"][:k + 1]  # generation ended on token k
    kept = history(engine, sid)
    assert kept is not None and kept[:len(case["input_ids"])] == case["input_ids"]
    generated = kept[len(case["input_ids"]):]
    # The history holds the text the client got and the stop string, nothing after it.
    assert engine.tokenizer.decode(generated) == result.text + stop
    if where == "at_end":
        assert generated == case["token_ids"][:k + 1]  # the sampled ids, exactly
    else:
        assert generated[:k] == case["token_ids"][:k]
        assert generated != case["token_ids"][:k + 1]
    follow_up = ask(engine, SESSIONS["session_text"]["turns"][1], session=sid)
    assert follow_up.finish_reason == "length"
    # the history's KV was reused
    assert follow_up.usage.cached_tokens >= reused(engine, len(kept) - 2)


def fresh(case: dict[str, Any]) -> list[int]:
    """What a session-less request with ``case``'s messages alone generates."""
    plain = Engine(parity_config(TINY, infer_requests=1, kv_cache_mb=0, image_cache_mb=0))
    return ask(plain, case).token_ids


def test_an_expired_or_evicted_session_is_started_afresh_and_reported() -> None:
    engine = Engine(parity_config(TINY, infer_requests=1, sessions_max=1,
                                  session_ttl_s=60))
    now = [1000.0]
    engine.sessions.clock = lambda: now[0]  # the store's clock, moved by hand
    first, second = SESSIONS["session_text"]["turns"][:2]
    expected = fresh(second)
    ask(engine, first, session="a")
    ask(engine, first, session="b")  # evicts a
    result = ask(engine, second, session="a")
    assert result.session == SessionInfo("a", turns=1, reset=True)
    assert result.token_ids == expected
    again = ask(engine, second, session="a")
    assert again.session == SessionInfo("a", turns=2, reset=False)
    now[0] += 61  # the TTL runs out
    expired = ask(engine, second, session="a")
    assert expired.session == SessionInfo("a", turns=1, reset=True)
    unknown = ask(engine, second, session="never-seen")
    assert unknown.session == SessionInfo("never-seen", turns=1, reset=False)


def test_a_history_whose_image_bytes_and_embedding_are_gone_is_reset() -> None:
    # No KV cache kept, no embeddings, no image bytes: turn 2 cannot be rebuilt exactly.
    engine = Engine(parity_config(TINY, infer_requests=1, kv_cache_mb=0, image_cache_mb=0,
                                  session_image_mb=0))
    ask(engine, IMAGE_SESSION[0], session="img")
    assert engine.sessions.stats()["image_bytes"] == 0
    result = ask(engine, IMAGE_SESSION[1], session="img")
    assert result.session == SessionInfo("img", turns=1, reset=True)
    assert result.token_ids == fresh(IMAGE_SESSION[1])


@pytest.mark.parametrize("kept", ["kv_cache", "embedding", "image_bytes"])
def test_a_history_with_any_way_to_rebuild_its_image_continues_exactly(kept: str) -> None:
    caches: dict[str, Any] = {"kv_cache_mb": 0, "image_cache_mb": 0, "session_image_mb": 0}
    caches.pop({"kv_cache": "kv_cache_mb", "embedding": "image_cache_mb",
                "image_bytes": "session_image_mb"}[kept])
    engine = Engine(parity_config(TINY, infer_requests=1, **caches))
    ask(engine, IMAGE_SESSION[0], session="img")
    result = ask(engine, IMAGE_SESSION[1], session="img")
    assert result.session == SessionInfo("img", turns=2, reset=False)
    assert result.token_ids == IMAGE_SESSION[1]["token_ids"]
