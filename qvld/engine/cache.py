"""What the engine keeps between requests: image embeddings and sessions.

The KV cache itself lives in the infer requests (see ``backend.SlotPool``); a session
only keeps the exact token history (the ids, images and their digests) that lets a
follow-up find its KV state again, or rebuild it when it was evicted.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from qvld.engine.image import PreparedImage
from qvld.engine.vision import ImageEmbedding
from qvld.errors import BadRequest, Busy, Forbidden


class ImageCache:
    """LRU of image embeddings by digest (content + pixel budget), bounded in bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[bytes, ImageEmbedding] = OrderedDict()
        self._grids: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _cost(item: ImageEmbedding) -> int:
        return int(item.embeds.nbytes + item.deepstack.nbytes)

    def get(self, digest: bytes) -> ImageEmbedding | None:
        with self._lock:
            item = self._items.get(digest)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(digest)
            self.hits += 1
            return item

    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            return digest in self._items

    def put(self, digest: bytes, item: ImageEmbedding) -> None:
        cost = self._cost(item)
        if cost > self.capacity_bytes:
            return
        with self._lock:
            if digest in self._items:
                return
            self._items[digest] = item
            self.size_bytes += cost
            while self.size_bytes > self.capacity_bytes:
                _, old = self._items.popitem(last=False)
                self.size_bytes -= self._cost(old)

    def discard(self, digest: bytes) -> None:
        with self._lock:
            item = self._items.pop(digest, None)
            if item is not None:
                self.size_bytes -= self._cost(item)
            self._grids.pop(digest, None)

    def grid(self, digest: bytes) -> tuple[int, int] | None:
        """The resized grid of an image seen before (lets a hit skip decoding)."""
        with self._lock:
            return self._grids.get(digest)

    def remember_grid(self, digest: bytes, grid: tuple[int, int]) -> None:
        with self._lock:
            self._grids[digest] = grid
            self._grids.move_to_end(digest)
            while len(self._grids) > 4096:
                self._grids.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._items), "bytes": self.size_bytes,
                    "capacity_bytes": self.capacity_bytes, "hits": self.hits,
                    "misses": self.misses}


@dataclass(eq=False)
class Session:
    """One conversation: its exact token history and the images in it, in order."""

    id: str
    uid: int
    ids: list[int] = field(default_factory=list)
    images: list[PreparedImage] = field(default_factory=list)
    image_starts: list[int] = field(default_factory=list)
    turns: int = 0
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def commit(self, ids: list[int], images: list[PreparedImage], starts: list[int]) -> None:
        self.ids = ids
        self.image_starts = starts
        # Keep what identifies each image, not its decoded pixels: the embedding cache
        # (or decoding ``data`` again) serves a later rebuild of this history.
        self.images = [replace(image, patches=None) for image in images]
        self.turns += 1
        self.last_used = time.monotonic()

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"id": self.id, "uid": self.uid, "turns": self.turns, "tokens": len(self.ids),
                "images": len(self.images), "age_s": round(now - self.created, 3),
                "idle_s": round(now - self.last_used, 3), "busy": self.lock.locked()}


class SessionStore:
    """Sessions by id; each belongs to the uid that created it."""

    def __init__(self, max_sessions: int, ttl_s: float) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s.id for s in self._sessions.values()
                    if now - s.last_used > self.ttl_s and not s.lock.locked()]:
            del self._sessions[sid]

    def open(self, sid: str, uid: int) -> Session:
        """The session ``sid`` of ``uid``, created if new (LRU eviction past the limit)."""
        if self.max_sessions == 0:
            raise BadRequest("sessions are disabled (engine.sessions_max is 0)")
        with self._lock:
            self._expire()
            session = self._sessions.get(sid)
            if session is not None:
                if session.uid != uid:
                    raise Forbidden(f"session {sid!r} belongs to another user")
                self._sessions.move_to_end(sid)
                self.hits += 1
                return session
            while len(self._sessions) >= self.max_sessions:
                victim = next((s for s in self._sessions.values() if not s.lock.locked()), None)
                if victim is None:
                    raise Busy("every session is in use; retry shortly")
                del self._sessions[victim.id]
            session = Session(id=sid, uid=uid)
            self._sessions[sid] = session
            return session

    def list(self, uid: int | None) -> list[dict[str, Any]]:
        """Sessions of ``uid`` (None: everyone's)."""
        with self._lock:
            self._expire()
            return [s.describe() for s in self._sessions.values() if uid in (None, s.uid)]

    def close(self, sid: str, uid: int, admin: bool = False) -> bool:
        with self._lock:
            session = self._sessions.get(sid)
            if session is None:
                return False
            if session.uid != uid and not admin:
                raise Forbidden(f"session {sid!r} belongs to another user")
            del self._sessions[sid]
            return True

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._sessions)
