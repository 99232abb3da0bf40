"""A lane: work run in order on threads of its own (one, or ``threads``), beside the
step loop.

Threads start with work and end when none is left, so an engine replaced by a reload
leaves no thread behind. Work reports its own results (it posts
them to the step loop's inbox); an exception that escapes it is logged, and the lane
goes on with the next.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("qvld.engine")


class Lane:
    def __init__(self, name: str, nice: int = 0, threads: int = 1) -> None:
        """``nice``: the threads' scheduling niceness beside the process's (higher:
        they get the cores when the step loop's threads leave them); ``threads``: how
        many pieces of work run at once (whoever submits bounds what is queued)."""
        self.name = name  # the threads'
        self.nice = nice
        self.threads = threads
        self._lock = threading.Lock()
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._running = 0  # threads

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` after what was submitted before it (with ``threads`` > 1,
        beside the work before it)."""
        with self._lock:
            self._queue.append(work)
            if self._running < self.threads:
                self._running += 1
                name = self.name if self.threads == 1 else f"{self.name}-{self._running}"
                threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        if self.nice:
            with contextlib.suppress(OSError):  # a thread may always lower its priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + self.nice)
        while True:
            with self._lock:
                if not self._queue:
                    self._running -= 1
                    return
                work = self._queue.popleft()
            try:
                work()
            except Exception:  # work reports its own errors; a bug's last stop
                log.exception("%s: work failed", self.name)
