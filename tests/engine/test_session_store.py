"""The session store on its own: per-user scope and limits, fair eviction, nothing
created before a turn commits, tombstones of lost sessions, the image-byte budget."""

from __future__ import annotations

import pytest

from qvld.engine.inputs.image import PixelBudget, PreparedImage
from qvld.engine.inputs.sessions import ID_BYTES, SessionStore, dropped
from qvld.errors import BadRequest, Busy


def image(n: int, size: int = 1000) -> PreparedImage:
    return PreparedImage(patches=None, grid_h=4, grid_w=4, merge_size=2,
                         digest=bytes([n]) * 32, data=bytes([n]) * size,
                         budget=PixelBudget(1024, 4096))


def commit(store: SessionStore, uid: int, sid: str, ids: list[int] | None = None,
           images: list[PreparedImage] | None = None) -> int:
    """One committed turn, as the engine runs it."""
    session, _ = store.lookup(uid, sid)
    turn = store.begin(uid, sid, session, session.version if session else 0)
    try:
        return store.commit(turn, ids or [1, 2, 3], images or [], [0] * len(images or []))
    finally:
        store.end(turn)


def ids_of(store: SessionStore, uid: int | None = None) -> list[tuple[int, str]]:
    return sorted((s["uid"], s["id"]) for s in store.list(uid))


def test_same_id_for_two_users_is_two_sessions() -> None:
    store = SessionStore(8, 60, per_user=4)
    commit(store, 1, "chat")
    commit(store, 2, "chat")
    commit(store, 2, "chat")
    assert [s["turns"] for s in store.list(1)] == [1]
    assert [s["turns"] for s in store.list(2)] == [2]
    assert store.close(2, "chat") and ids_of(store) == [(1, "chat")]
    assert not store.close(2, "chat")


def test_closing_a_user_ends_all_of_theirs_and_nobody_elses() -> None:
    store = SessionStore(8, 60, per_user=4)
    for sid in ("a", "b", "c"):
        commit(store, 7, sid)
    commit(store, 8, "a")
    assert store.close_user(7) == 3
    assert ids_of(store) == [(8, "a")]
    assert store.close_user(7) == 0


def test_nothing_exists_until_a_turn_commits() -> None:
    store = SessionStore(8, 60, per_user=4)
    turn = store.begin(1, "new", None, 0)
    assert store.list(None) == [] and len(store) == 0
    with pytest.raises(Busy):  # the same new id, concurrently
        store.begin(1, "new", None, 0)
    store.end(turn)  # refused, cancelled or timed out: never committed
    assert store.list(None) == [] and store.lookup(1, "new") == (None, False)
    assert commit(store, 1, "new") == 1


def test_a_user_at_their_limit_loses_their_own_oldest_idle_session() -> None:
    store = SessionStore(10, 60, per_user=2)
    commit(store, 1, "a")
    commit(store, 2, "x")
    commit(store, 1, "b")
    commit(store, 1, "c")
    assert ids_of(store) == [(1, "b"), (1, "c"), (2, "x")]


def test_a_full_store_takes_from_whoever_holds_the_most() -> None:
    store = SessionStore(4, 60, per_user=3)
    commit(store, 2, "old")  # the oldest session of all, but its owner holds only one
    for sid in ("a", "b", "c"):
        commit(store, 1, sid)
    commit(store, 3, "new")
    assert ids_of(store) == [(1, "b"), (1, "c"), (2, "old"), (3, "new")]
    commit(store, 3, "newer")  # uids 1 and 3 then hold two each: 1's oldest goes
    assert ids_of(store) == [(1, "c"), (2, "old"), (3, "new"), (3, "newer")]
    # A newcomer holding as many as the most (its new one counted) loses its own oldest.
    commit(store, 2, "again")
    assert ids_of(store) == [(1, "c"), (2, "again"), (3, "new"), (3, "newer")]


def test_busy_sessions_are_never_evicted() -> None:
    store = SessionStore(1, 60, per_user=1)
    commit(store, 1, "a")
    session, _ = store.lookup(1, "a")
    assert session is not None
    turn = store.begin(1, "a", session, session.version)
    with pytest.raises(Busy, match="in use"):
        store.begin(2, "b", None, 0)
    store.end(turn)
    commit(store, 2, "b")
    assert ids_of(store) == [(2, "b")]


def test_lost_sessions_are_remembered_and_closing_your_own_is_not_lost() -> None:
    store = SessionStore(1, 60, per_user=1)
    commit(store, 1, "a")
    commit(store, 1, "b")  # evicts a
    assert store.lookup(1, "a") == (None, True)
    assert store.lookup(2, "a") == (None, False)  # another user never had it
    assert commit(store, 1, "a") == 1  # a fresh start, committed ...
    assert store.lookup(1, "a")[1] is False  # ... ends the tombstone
    assert store.close(1, "a")
    assert store.lookup(1, "a") == (None, False)  # closed by its owner: they know
    commit(store, 1, "c")
    assert store.close(1, "c", by_owner=False)  # an admin closed it
    assert store.lookup(1, "c") == (None, True)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_expired_sessions_are_lost_and_said_so() -> None:
    clock = Clock()
    removed: list[tuple[int, str]] = []
    store = SessionStore(4, 900, per_user=4, clock=clock,
                         on_removed=lambda uid, sid: removed.append((uid, sid)))
    commit(store, 1, "a")
    clock.now += 600
    commit(store, 1, "b")
    assert store.list(1)[0]["idle_s"] == 600
    clock.now += 301  # past a's TTL; b has 299 s left
    assert store.lookup(1, "a") == (None, True)
    assert store.lookup(1, "b")[0] is not None
    assert removed == [(1, "a")]
    store.close(1, "b")
    store.close_user(1)
    assert removed == [(1, "a"), (1, "b")]  # told once each, however it left


def test_a_moved_on_or_vanished_session_is_noticed_at_begin() -> None:
    store = SessionStore(4, 60, per_user=4)
    commit(store, 1, "a")
    seen, _ = store.lookup(1, "a")
    assert seen is not None
    version = seen.version
    commit(store, 1, "a")
    with pytest.raises(Busy, match="moved on"):
        store.begin(1, "a", seen, version)
    store.close(1, "a")
    turn = store.begin(1, "a", seen, seen.version)  # gone: the turn makes a new one
    assert turn.new
    store.end(turn)


def test_image_bytes_beyond_the_budget_are_dropped_oldest_first() -> None:
    store = SessionStore(8, 60, per_user=8, image_budget_bytes=2500)
    commit(store, 1, "a", images=[image(1), image(2)])
    commit(store, 2, "b", images=[image(3)])
    kept = {s.id: [not dropped(i) for i in s.images]
            for s in (store.lookup(1, "a")[0], store.lookup(2, "b")[0]) if s is not None}
    assert kept == {"a": [False, True], "b": [True]}
    stats = store.stats()
    assert stats["image_bytes"] == 2000
    assert stats["bytes"] == 2000 + 2 * 3 * ID_BYTES
    # What identifies an image stays: a rebuild can still find its embedding.
    a, _ = store.lookup(1, "a")
    assert a is not None and a.images[0].digest == bytes([1]) * 32


def test_sessions_disabled() -> None:
    with pytest.raises(BadRequest, match="disabled"):
        SessionStore(0, 60).lookup(1, "a")


def test_a_reload_turns_the_old_stores_sessions_into_tombstones() -> None:
    old = SessionStore(1, 60, per_user=1)
    commit(old, 1, "evicted")
    commit(old, 1, "live")
    new = SessionStore(4, 60, per_user=4)
    new.inherit(old)
    assert new.list(None) == []
    assert new.lookup(1, "live") == (None, True)
    assert new.lookup(1, "evicted") == (None, True)
    assert new.lookup(2, "live") == (None, False)
