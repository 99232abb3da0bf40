"""Sessions: each user's conversations, their exact token histories, and what they cost.

A session keeps the exact token history (the ids, and which images sit where) that lets
a follow-up find its KV state again, or rebuild it when it was evicted. Sessions are
keyed by (uid, id): two users may use the same id, and nothing one user does with
sessions (create, evict, close, refuse) depends on or reveals another user's.

A session exists only once a turn has committed to it; a refused, timed-out or
cancelled request leaves nothing behind. Ids of sessions that ended without their owner
closing them (expired, evicted, closed by an admin) are remembered for a while
(tombstones), so that a follow-up naming one is answered from a fresh context and told
so (``reset``) instead of silently losing its history.
"""

from __future__ import annotations

import collections
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from qvld.engine.inputs.image import PreparedImage
from qvld.engine.model.tokenizer import TextTokenizer
from qvld.errors import BadRequest, Busy

SessionKey = tuple[int, str]  # (uid, session id)

# What one history id costs in memory: a list slot and an int object.
ID_BYTES = 36
# Ended session ids remembered per uid, and uids remembered (oldest forgotten first).
TOMBSTONES_PER_USER = 64
TOMBSTONE_USERS = 1024


def dropped(image: PreparedImage) -> bool:
    """Whether a session let this image's raw bytes go (``data`` is then b"": no real
    image is empty, the decoder refuses that)."""
    return not image.data


@dataclass(eq=False)
class Session:
    """One conversation: its exact token history and the images in it, in order.

    ``images`` keep what identifies each image (digest, grid, budget), never decoded
    pixels, and their raw bytes only while the store's image budget allows.
    """

    id: str
    uid: int
    ids: list[int] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)
    image_starts: list[int] = field(default_factory=list)
    turns: int = 0
    # Bumped by every commit (turns alone can repeat: a reset starts them again).
    version: int = 0
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def image_bytes(self) -> int:
        return sum(len(image.data) for image in self.images)

    @property
    def size_bytes(self) -> int:
        return len(self.ids) * ID_BYTES + self.image_bytes

    def describe(self, now: float) -> dict[str, Any]:
        return {"id": self.id, "uid": self.uid, "turns": self.turns, "tokens": len(self.ids),
                "images": len(self.images), "bytes": self.size_bytes,
                "age_s": round(now - self.created, 3),
                "idle_s": round(now - self.last_used, 3), "busy": self.lock.locked()}


@dataclass(eq=False)
class Turn:
    """A request running on a session: the session is locked until ``SessionStore.end``.
    ``new``: the session is not in the store yet (its first turn must commit first)."""

    session: Session
    new: bool
    stored: bool = False


class SessionStore:
    def __init__(self, max_sessions: int, ttl_s: float, per_user: int | None = None,
                 image_budget_bytes: int | None = None,
                 on_removed: Callable[[int, str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        # Told (uid, id) whenever a session leaves the store, however (closed, expired,
        # evicted, its user's key revoked): the engine lets go of its pinned KV blocks
        # then, not when someone happens to read the stats.
        self.on_removed = on_removed
        self.clock = clock  # tests pass their own, to expire sessions without sleeping
        self.per_user = min(per_user or max_sessions, max_sessions)
        self.ttl_s = ttl_s
        self.image_budget_bytes = image_budget_bytes
        self._sessions: OrderedDict[SessionKey, Session] = OrderedDict()  # LRU first
        self._pending: set[SessionKey] = set()  # new sessions whose first turn runs
        self._tombstones: OrderedDict[int, OrderedDict[str, None]] = OrderedDict()
        self._lock = threading.Lock()

    # -- tombstones (lock held) -----------------------------------------------------

    def _bury(self, uid: int, sid: str) -> None:
        ids = self._tombstones.pop(uid, None) or OrderedDict()
        ids[sid] = None
        while len(ids) > TOMBSTONES_PER_USER:
            ids.popitem(last=False)
        self._tombstones[uid] = ids
        while len(self._tombstones) > TOMBSTONE_USERS:
            self._tombstones.popitem(last=False)

    def _unbury(self, uid: int, sid: str) -> None:
        ids = self._tombstones.get(uid)
        if ids is not None:
            ids.pop(sid, None)

    def _remove(self, session: Session, bury: bool) -> None:
        del self._sessions[(session.uid, session.id)]
        if bury:
            self._bury(session.uid, session.id)
        if self.on_removed is not None:
            self.on_removed(session.uid, session.id)

    def _expire(self) -> None:
        now = self.clock()
        for session in [s for s in self._sessions.values()
                        if now - s.last_used > self.ttl_s and not s.lock.locked()]:
            self._remove(session, bury=True)

    # -- a request's life: lookup (prepare), begin .. commit .. end (run) -------------

    def lookup(self, uid: int, sid: str) -> tuple[Session | None, bool]:
        """``uid``'s session ``sid`` (never created here), and whether that id names a
        session this user had and lost (the turn then starts afresh: ``reset``)."""
        if self.max_sessions == 0:
            raise BadRequest("sessions are disabled (engine.sessions_max is 0)")
        with self._lock:
            self._expire()
            session = self._sessions.get((uid, sid))
            if session is not None:
                self._sessions.move_to_end((uid, sid))
                return session, False
            return None, sid in self._tombstones.get(uid, ())

    def begin(self, uid: int, sid: str, seen: Session | None, seen_version: int) -> Turn:
        """Lock the session a prepared request continues (``seen``, at ``seen_version``),
        or a new one when there was none or it is gone since. Busy when another request
        holds it, it moved on, or no session could make room."""
        key = (uid, sid)
        with self._lock:
            self._expire()
            current = self._sessions.get(key)
            if current is not None and current is seen:
                if not current.lock.acquire(blocking=False):
                    raise Busy(f"session {sid!r} is answering another request")
                if current.version != seen_version:
                    current.lock.release()
                    raise Busy(f"session {sid!r} moved on since this request was "
                               "prepared; retry")
                return Turn(current, new=False, stored=True)
            if current is not None:
                raise Busy(f"session {sid!r} moved on since this request was prepared; retry")
            if key in self._pending:
                raise Busy(f"session {sid!r} is answering another request")
            if not self._room_possible(uid):
                raise Busy("every session is in use; retry shortly")
            now = self.clock()
            session = Session(id=sid, uid=uid, created=now, last_used=now)
            session.lock.acquire()
            self._pending.add(key)
            return Turn(session, new=True)

    def commit(self, turn: Turn, ids: list[int], images: list[PreparedImage],
               starts: list[int], reset: bool = False) -> int:
        """Record a finished turn's history; the session's turns afterwards.

        ``reset``: the history replaces the old one (the session started afresh)."""
        session = turn.session
        key = (session.uid, session.id)
        with self._lock:
            session.ids = ids
            session.image_starts = starts
            session.images = [replace(image, patches=None) for image in images]
            session.turns = 1 if reset else session.turns + 1
            session.last_used = self.clock()
            if reset:
                session.created = session.last_used
            session.version += 1
            if turn.new:
                self._pending.discard(key)
                self._unbury(*key)
                if self._make_room(session.uid):
                    self._sessions[key] = session
                    turn.stored = True
                else:  # every other session became busy meanwhile: not kept, and said so
                    self._bury(*key)
            elif self._sessions.get(key) is session:
                self._sessions.move_to_end(key)
            self._fit_image_budget()
            return session.turns

    def end(self, turn: Turn) -> None:
        """The request is over (committed or not): unlock; a new session that never
        committed leaves nothing behind."""
        with self._lock:
            if turn.new and not turn.stored:
                self._pending.discard((turn.session.uid, turn.session.id))
        turn.session.lock.release()

    # -- room (lock held) -----------------------------------------------------------

    def _idle(self, uid: int | None = None) -> list[Session]:
        """Idle sessions (of ``uid``, or everyone's), least recently used first."""
        return [s for s in self._sessions.values()
                if not s.lock.locked() and uid in (None, s.uid)]

    def _room_possible(self, uid: int) -> bool:
        mine = sum(1 for s in self._sessions.values() if s.uid == uid)
        if mine >= self.per_user and not self._idle(uid):
            return False
        return len(self._sessions) < self.max_sessions or bool(self._idle())

    def _make_room(self, uid: int) -> bool:
        """Evict until ``uid`` may add a session: first their own beyond the per-user
        limit; then, with the store full, the least recently used idle session of
        whoever holds the most (the newcomer counted), so nobody loses a session to a
        user holding more than they do. False when nothing idle can go."""
        while sum(1 for s in self._sessions.values() if s.uid == uid) >= self.per_user:
            own = self._idle(uid)
            if not own:
                return False
            self._remove(own[0], bury=True)
        while len(self._sessions) >= self.max_sessions:
            idle = self._idle()
            if not idle:
                return False
            counts = collections.Counter(s.uid for s in self._sessions.values())
            counts[uid] += 1
            most = max(counts[s.uid] for s in idle)
            self._remove(next(s for s in idle if counts[s.uid] == most), bury=True)
        return True

    def _fit_image_budget(self) -> None:
        """Drop raw image bytes, least recently used sessions first, past the budget.
        The images stay identified (digest, grid): a rebuild can still use their cached
        embeddings, or the KV cache may still hold the whole history."""
        if self.image_budget_bytes is None:
            return
        held = sum(s.image_bytes for s in self._sessions.values())
        for session in self._sessions.values():
            if held <= self.image_budget_bytes:
                return
            for n, image in enumerate(session.images):
                if not dropped(image) and held > self.image_budget_bytes:
                    held -= len(image.data)
                    session.images[n] = replace(image, data=b"")

    # -- listing and closing --------------------------------------------------------

    def list(self, uid: int | None) -> list[dict[str, Any]]:
        """Sessions of ``uid`` (None: everyone's)."""
        with self._lock:
            self._expire()
            now = self.clock()
            return [s.describe(now) for s in self._sessions.values() if uid in (None, s.uid)]

    def has(self, uid: int, sid: str) -> bool:
        """Whether ``uid``'s session ``sid`` is stored (no LRU move, no expiry)."""
        with self._lock:
            return (uid, sid) in self._sessions

    def close(self, uid: int, sid: str, by_owner: bool = True) -> bool:
        """Close ``uid``'s session ``sid``; False if there is none. Closed by someone
        else (an admin), its owner's next request on it is told it was reset."""
        with self._lock:
            session = self._sessions.get((uid, sid))
            if session is None:
                return False
            self._remove(session, bury=not by_owner)
            if by_owner:
                self._unbury(uid, sid)
            return True

    def close_user(self, uid: int) -> int:
        """End every session of ``uid`` (a revoked API key's); how many there were. A
        turn running now still finishes (its user can never ask again)."""
        with self._lock:
            ended = [s for s in self._sessions.values() if s.uid == uid]
            for session in ended:
                self._remove(session, bury=False)
            self._tombstones.pop(uid, None)
            return len(ended)

    def inherit(self, old: SessionStore) -> None:
        """Take over from the store of the engine a reload replaced. Its sessions cannot
        follow (their histories and KV caches belong to the old model), so each becomes
        a tombstone here, as do the old tombstones: a follow-up is told (reset)."""
        with old._lock:
            ended = [(s.uid, s.id) for s in old._sessions.values()]
            ended[:0] = [(uid, sid) for uid, ids in old._tombstones.items() for sid in ids]
        with self._lock:
            for uid, sid in ended:
                if (uid, sid) not in self._sessions:
                    self._bury(uid, sid)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            self._expire()
            return {"entries": len(self._sessions),
                    "bytes": sum(s.size_bytes for s in self._sessions.values()),
                    "image_bytes": sum(s.image_bytes for s in self._sessions.values()),
                    "image_budget_bytes": self.image_budget_bytes}

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._sessions)


@dataclass
class TurnInputs:
    """What one generation feeds: ids, images and where each starts (a session's
    history included), the history's image embeddings kept for it (by digest), and
    whether its session started afresh."""

    ids: list[int]
    images: list[PreparedImage]
    starts: list[int]
    pinned: dict[bytes, Any] | None = None
    reset: bool = False


def continued(turn: Turn, ids: list[int], images: list[PreparedImage], starts: list[int],
              history_images: list[PreparedImage], pinned: dict[bytes, Any],
              reset: bool) -> TurnInputs:
    """A turn's inputs: the new ``ids`` (``images`` at ``starts``) after the session's
    history (whose images, as prepared, are ``history_images``), or alone for a new
    session."""
    if turn.new:
        return TurnInputs(ids, images, starts, reset=reset)
    session = turn.session
    return TurnInputs(session.ids + ids, history_images + images,
                      session.image_starts + [len(session.ids) + s for s in starts],
                      pinned=pinned, reset=reset)


def kept_ids(tokenizer: TextTokenizer, ids: list[int], text: str, finish_reason: str,
             stops: Sequence[str], eos: Sequence[int]) -> list[int]:
    """The generated ids a session keeps: all, except after a stop string, where only
    those through the stop string (the client never got the text beyond it)."""
    if finish_reason != "stop" or not ids or ids[-1] in eos:
        return ids
    return ids_through_stop(tokenizer, ids, text, stops)


def ids_through_stop(tokenizer: TextTokenizer, ids: list[int], shown: str,
                     stops: Sequence[str]) -> list[int]:
    """The generated ``ids`` a session keeps when a stop string ended generation: those
    whose text is exactly ``shown`` (what the client got) followed by the stop string.

    When the stop string ends on a token boundary these are the sampled ids up to it.
    When it ends inside a token (the token also holds text beyond it), that token and
    any before it that do not decode to a prefix of the text are replaced by the
    re-tokenised remainder: the history's text is then exact, its last few ids may
    differ from the sampled ones. The KV cache rows of the sampled ids are simply not
    reused past the point where the two differ, so follow-ups stay exact.
    """
    full = tokenizer.decode(ids)
    ends = [len(shown) + len(stop) for stop in stops
            if stop and full.startswith(stop, len(shown))]
    if not ends or not full.startswith(shown):
        return list(ids)  # not a stop string's cut: keep what was generated
    target = full[:min(ends)]
    k = len(ids)
    while k > 1 and tokenizer.decode(ids[:k - 1]).startswith(target):
        k -= 1  # the fewest ids whose text covers the stop string
    if tokenizer.decode(ids[:k]) == target:
        return list(ids[:k])
    for j in range(k - 1, -1, -1):
        text = tokenizer.decode(ids[:j])
        if target.startswith(text):
            return list(ids[:j]) + tokenizer.encode(target[len(text):])
    return list(ids)  # unreachable: ids[:0] decodes to "", a prefix of anything
