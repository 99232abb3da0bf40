"""Slot workers: the threads that run work needing a slot (``engine.infer_requests``).

A slot encodes a request's images and embeds its prompt and is free again once the
sequence is handed to the step loop (whatever runtime steps it). One thread per slot,
started when work arrives and gone when none is left.

Waiting work is taken round-robin between uids, and one uid runs on at most
``workers - 1`` threads while another uid's work waits (unless there is one thread),
so one user's burst of large images does not hold every slot. Work whose client left
or whose deadline passed before it started is dropped without running (``on_drop``).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from qvld.errors import Unavailable
from qvld.fairqueue import FairQueue

log = logging.getLogger("qvld.engine")


@dataclass(eq=False)
class Work:
    uid: int
    run: Callable[[], None]  # reports its own outcome; exceptions are logged only
    should_stop: Callable[[], bool]
    on_drop: Callable[[], None]  # stopped before it ran


class SlotWorkers:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.per_uid = max(1, workers - 1)
        self._lock = threading.Condition()
        self._waiting: FairQueue[Work] = FairQueue()
        self._running: collections.Counter[int] = collections.Counter()
        self._threads = 0
        self._closed = False

    def submit(self, work: Work) -> None:
        with self._lock:
            if self._closed:
                raise Unavailable("the daemon is shutting down")
            self._waiting.push(work.uid, work)
            if self._threads < self.workers:
                self._threads += 1
                threading.Thread(target=self._work, name=f"qvld-slot-{self._threads}",
                                 daemon=True).start()
            self._lock.notify()

    def remove(self, work: Work) -> bool:
        """Take waiting ``work`` out; False when it started already (or ended)."""
        with self._lock:
            return self._waiting.remove(work.uid, work)

    def close(self) -> list[Work]:
        """Take no more work; what was waiting, removed (its owner ends it)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            return self._waiting.clear()

    def _eligible(self, uid: int) -> bool:
        """Whether ``uid`` may take another thread (lock held)."""
        others_wait = any(u != uid for u in self._waiting.uids())
        return not others_wait or self._running[uid] < self.per_uid

    def _take(self) -> Work | None:
        with self._lock:
            while True:
                work = self._waiting.pop(self._eligible)
                if work is not None:
                    self._running[work.uid] += 1
                    return work
                if not len(self._waiting) or self._closed:
                    self._threads -= 1
                    return None
                self._lock.wait()  # only ineligible work waits: a thread ending frees it

    def _work(self) -> None:
        while (work := self._take()) is not None:
            try:
                if work.should_stop():
                    work.on_drop()
                else:
                    work.run()
            except Exception:  # run reports its own errors; this is a bug's last stop
                log.exception("slot work failed")
            finally:
                with self._lock:
                    self._running[work.uid] -= 1
                    if not self._running[work.uid]:
                        del self._running[work.uid]
                    self._lock.notify_all()
