"""What the engine keeps between requests: image embeddings (sessions: ``sessions.py``).

The KV cache itself lives in the infer requests (see ``backend.SlotPool``). Both caches
are per user unless ``engine.share_caches`` is on: a hit is faster and says so in the
reply (usage.cached_tokens, timings.image_s), so a cache shared between users would
let one user confirm a guess of what another sent.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from qvld.engine.inputs.vision import ImageEmbedding

# (owner, image digest): the owner is the uid whose requests may reuse the entry, or
# None when caches are shared by everyone (engine.share_caches).
ImageKey = tuple[int | None, bytes]


class ImageCache:
    """LRU of image embeddings by (owner, digest of content + pixel budget), in bytes."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[ImageKey, ImageEmbedding] = OrderedDict()
        self._grids: OrderedDict[ImageKey, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _cost(item: ImageEmbedding) -> int:
        return int(item.embeds.nbytes + item.deepstack.nbytes)

    def get(self, key: ImageKey, pinned: ImageEmbedding | None = None) -> ImageEmbedding | None:
        """The cached embedding (a hit), else ``pinned`` (a copy the caller held on to
        since it was looked up; put back, counted as a hit), else None (a miss)."""
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return item
            if pinned is None:
                self.misses += 1
                return None
            self.hits += 1
        self.put(key, pinned)
        return pinned

    def peek(self, key: ImageKey) -> ImageEmbedding | None:
        """The cached embedding without counting a lookup or refreshing its age."""
        with self._lock:
            return self._items.get(key)

    def __contains__(self, key: ImageKey) -> bool:
        with self._lock:
            return key in self._items

    def put(self, key: ImageKey, item: ImageEmbedding) -> None:
        cost = self._cost(item)
        if cost > self.capacity_bytes:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = item
            self.size_bytes += cost
            while self.size_bytes > self.capacity_bytes:
                _, old = self._items.popitem(last=False)
                self.size_bytes -= self._cost(old)

    def discard(self, key: ImageKey) -> None:
        with self._lock:
            item = self._items.pop(key, None)
            if item is not None:
                self.size_bytes -= self._cost(item)
            self._grids.pop(key, None)

    def grid(self, key: ImageKey) -> tuple[int, int] | None:
        """The resized grid of an image this owner sent before (lets a hit skip decoding;
        per owner too, since skipping the decode shows in timings.image_s)."""
        with self._lock:
            return self._grids.get(key)

    def remember_grid(self, key: ImageKey, grid: tuple[int, int]) -> None:
        with self._lock:
            self._grids[key] = grid
            self._grids.move_to_end(key)
            while len(self._grids) > 4096:
                self._grids.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._items), "bytes": self.size_bytes,
                    "capacity_bytes": self.capacity_bytes, "hits": self.hits,
                    "misses": self.misses}
