"""Waiting work per user, taken round-robin, and results handed back to the event loop.

Used by the prepare stage and the grammar compiler: a few worker threads in front of
which one user's burst must not starve another user's single request (in the engine,
the step scheduler is the one queue); ``within_share`` is the busy bound of the prepare
stage and the engine.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Items per uid; ``pop`` takes from the uid at the front of the rotation and sends
    that uid to the back. Not thread-safe: its owner holds a lock around every call."""

    def __init__(self) -> None:
        self._by_uid: collections.OrderedDict[int, collections.deque[T]] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_uid.values())

    def __iter__(self) -> Iterator[T]:
        return (item for queue in self._by_uid.values() for item in queue)

    def count(self, uid: int) -> int:
        """Items waiting for ``uid``."""
        queue = self._by_uid.get(uid)
        return 0 if queue is None else len(queue)

    def uids(self) -> list[int]:
        """The uids with waiting items, in rotation order."""
        return list(self._by_uid)

    def push(self, uid: int, item: T) -> None:
        self._by_uid.setdefault(uid, collections.deque()).append(item)

    def remove(self, uid: int, item: T) -> bool:
        """Take ``item`` out; False if it is not waiting (a worker has it already)."""
        queue = self._by_uid.get(uid)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        if not queue:
            del self._by_uid[uid]
        return True

    def peek(self, uid: int) -> T | None:
        """``uid``'s next item, left where it is."""
        queue = self._by_uid.get(uid)
        return queue[0] if queue else None

    def pop(self, eligible: Callable[[int], bool] = lambda uid: True) -> T | None:
        """The next item of the first ``eligible`` uid in the rotation, or None."""
        uid = next((u for u in self._by_uid if eligible(u)), None)
        if uid is None:
            return None
        queue = self._by_uid.pop(uid)
        item = queue.popleft()
        if queue:  # the uid goes to the back of the rotation
            self._by_uid[uid] = queue
        return item

    def clear(self) -> list[T]:
        """Every waiting item, removed."""
        items = list(self)
        self._by_uid.clear()
        return items


def within_share(*, total: int, held: int, others: int, asked: int, capacity: int) -> bool:
    """Whether a user holding ``held`` of a queue's ``total`` entries, beside ``others``
    other users holding some, may add ``asked`` more (``n`` choices count each) to a
    queue of ``capacity``: anyone may while there is room; when it is full, a user
    within its fair share (``capacity`` split between the users holding entries, the
    asker included) still may. So one user filling the queue makes only itself busy,
    never the others. The total can pass ``capacity`` only by shares taken as users
    arrive: at most ``capacity`` x (1 + 1/2 + ... + 1/users) in all."""
    if total + asked <= capacity:
        return True
    return held + asked <= capacity // (others + 1)


def settle_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future[T],
                      value: T | None, error: BaseException | None) -> None:
    """From a worker thread: resolve ``future`` on its loop (unless already done)."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)  # type: ignore[arg-type]

    with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
        loop.call_soon_threadsafe(settle)
