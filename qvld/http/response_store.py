"""Each user's stored Responses (OpenAI's Responses API, ``store``: the default): the
response object and the conversation that led to it, for ``GET``/``DELETE`` and
``previous_response_id``. Kept in memory, per user, never shared; lost at a restart."""

from __future__ import annotations

import collections
import threading
from typing import Any

from qvld.errors import QvlError
from qvld.http.dialect import bad

# What one user may keep for previous_response_id: the oldest go first.
KEPT_PER_USER = 64
KEPT_BYTES_PER_USER = 64 << 20


class NotFound(QvlError):
    """A stored response this user does not have (HTTP 404)."""

    code = "not_found"


def _size(value: Any) -> int:
    """About the bytes ``value`` holds (images' bytes, text)."""
    if isinstance(value, bytes | str):
        return len(value)
    if isinstance(value, dict):
        return sum(_size(v) for v in value.values()) + 16
    if isinstance(value, list):
        return sum(_size(v) for v in value) + 8
    return 8


# A stored response: the object, the conversation that led to it, its size.
Kept = tuple[dict[str, Any], list[dict[str, Any]], int]
NOTHING: collections.OrderedDict[str, Kept] = collections.OrderedDict()


class ResponseStore:
    """Each user's stored responses (``store``, the default): the response object and
    the conversation that led to it, for ``GET``/``DELETE`` and ``previous_response_id``.
    At most ``KEPT_PER_USER`` of them and ``KEPT_BYTES_PER_USER`` (images count) per
    user: the oldest go first. Never shared between users."""

    def __init__(self, per_user: int = KEPT_PER_USER,
                 bytes_per_user: int = KEPT_BYTES_PER_USER) -> None:
        self.per_user = per_user
        self.bytes_per_user = bytes_per_user
        self._lock = threading.Lock()
        # uid -> response id -> (response, conversation, size), oldest first
        self._kept: dict[int, collections.OrderedDict[str, Kept]] = {}

    def keep(self, uid: int, response: dict[str, Any],
             conversation: list[dict[str, Any]]) -> None:
        size = _size(conversation)
        with self._lock:
            mine = self._kept.setdefault(uid, collections.OrderedDict())
            mine[response["id"]] = (response, conversation, size)
            while mine and (len(mine) > self.per_user or
                            sum(s for _, _, s in mine.values()) > self.bytes_per_user):
                mine.popitem(last=False)

    def conversation(self, uid: int, rid: str) -> list[dict[str, Any]]:
        with self._lock:
            found = self._kept.get(uid, NOTHING).get(rid)
        if found is None:
            raise bad("previous_response_id", f"previous response {rid!r} not found "
                      "(kept per user, the latest only; store: false keeps none)")
        return list(found[1])

    def get(self, uid: int, rid: str) -> dict[str, Any]:
        with self._lock:
            found = self._kept.get(uid, NOTHING).get(rid)
        if found is None:
            raise NotFound(f"response {rid!r} not found")
        return found[0]

    def delete(self, uid: int, rid: str) -> None:
        with self._lock:
            mine = self._kept.get(uid, NOTHING)
            if rid not in mine:
                raise NotFound(f"response {rid!r} not found")
            del mine[rid]
