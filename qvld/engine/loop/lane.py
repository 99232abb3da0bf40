"""A lane: work run in order on a thread of its own, beside the step loop.

The thread starts with the first piece of work and ends when none is left, so an engine
replaced by a reload leaves no thread behind. Work reports its own results (it posts
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
    def __init__(self, name: str, nice: int = 0) -> None:
        """``nice``: the thread's scheduling niceness beside the process's (higher:
        it gets the cores when the step loop's threads leave them)."""
        self.name = name  # the thread's
        self.nice = nice
        self._lock = threading.Lock()
        self._queue: collections.deque[Callable[[], None]] = collections.deque()
        self._thread: threading.Thread | None = None

    def submit(self, work: Callable[[], None]) -> None:
        """Run ``work`` after what was submitted before it."""
        with self._lock:
            self._queue.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name,
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        if self.nice:
            with contextlib.suppress(OSError):  # a thread may always lower its priority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + self.nice)
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                work = self._queue.popleft()
            try:
                work()
            except Exception:  # work reports its own errors; a bug's last stop
                log.exception("%s: work failed", self.name)
