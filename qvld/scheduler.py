"""Bounded, fair work queue in front of the engine's worker threads.

A job is admitted when the number of waiting jobs is below ``queue_max`` and its KV
cache fits the memory budget beside the jobs already admitted; otherwise ``busy``
(retryable). A job whose KV cache exceeds the whole budget is ``bad_request``: no retry
can help it. Waiting jobs are taken round-robin between uids, so one user's burst
cannot starve another's single request. A job whose deadline passes or which is
cancelled while waiting never reaches the engine; one that is running stops within a
decode step (the engine polls ``should_stop``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qvld.config import Config
from qvld.engine.types import GenerateResult, Timings, Usage
from qvld.errors import BadRequest, Busy, QvlError, Timeout, Unavailable
from qvld.fairqueue import FairQueue, settle_threadsafe

log = logging.getLogger("qvld.scheduler")


@dataclass(eq=False)  # jobs are identities (kept in sets), not values
class Job:
    """One admitted generation. ``run`` does the work on a worker thread."""

    uid: int
    run: Callable[[Job], GenerateResult]
    deadline: float  # time.monotonic()
    kv_bytes: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None
    future: asyncio.Future[GenerateResult] | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or time.monotonic() >= self.deadline

    @property
    def timed_out(self) -> bool:
        return time.monotonic() >= self.deadline and not self.cancelled.is_set()


def cancelled_result() -> GenerateResult:
    return GenerateResult(text="", token_ids=[], finish_reason="cancelled", usage=Usage(),
                          timings=Timings())


class Scheduler:
    def __init__(self, workers: int, queue_max: int, kv_budget_bytes: int | None) -> None:
        self.workers = workers
        self.queue_max = queue_max
        self.kv_budget_bytes = kv_budget_bytes
        self._lock = threading.Condition()
        self._waiting: FairQueue[Job] = FairQueue()
        self._running: set[Job] = set()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"qvld-worker-{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def reconfigure(self, config: Config) -> None:
        """A reload's limits (the number of workers needs a restart)."""
        with self._lock:
            self.queue_max = config.server.queue_max
            self.kv_budget_bytes = config.engine.kv_admission_bytes

    # -- queries ----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def jobs(self) -> list[Job]:
        with self._lock:
            return [*self._running, *self._waiting]

    # -- admission ----------------------------------------------------------------------

    async def submit(self, job: Job) -> GenerateResult:
        """Queue ``job`` and wait for its result (errors raise their QvlError)."""
        job.loop = asyncio.get_running_loop()
        job.future = job.loop.create_future()
        with self._lock:
            if self._closed:
                raise Unavailable("the daemon is shutting down")
            if self.kv_budget_bytes is not None:
                if job.kv_bytes > self.kv_budget_bytes:
                    # It could never run, however long the client waited: not retryable.
                    raise BadRequest(
                        f"this request needs {job.kv_bytes / 2**20:.1f} MiB of KV cache "
                        "(its prompt, session history and max_tokens), more than the whole "
                        f"budget of {self.kv_budget_bytes / 2**20:.1f} MiB "
                        "(engine.kv_cache_mb); ask for fewer tokens or start a new session")
                if self._reserved_bytes() + job.kv_bytes > self.kv_budget_bytes:
                    raise Busy("the KV-cache memory budget is taken; retry shortly")
            idle = self.workers - len(self._running)
            if len(self._waiting) - idle >= self.queue_max:
                raise Busy(f"the queue is full ({self.queue_max} waiting); retry shortly")
            self._waiting.push(job.uid, job)
            self._lock.notify()
        remaining = max(0.0, job.deadline - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), remaining + 0.05)
        except asyncio.TimeoutError:
            if self._unqueue(job):
                raise Timeout("the deadline passed while queued") from None
            return await job.future  # running: it stops at its next step

    def _unqueue(self, job: Job) -> bool:
        """Take a waiting job out of the queue; False if a worker has it already."""
        with self._lock:
            return self._waiting.remove(job.uid, job)

    def cancel(self, job: Job) -> None:
        """Cancel a job: a waiting one ends now, a running one at its next step."""
        job.cancelled.set()
        if job.future is not None and self._unqueue(job):
            self._finish(job, cancelled_result(), None)

    def _take(self) -> Job | None:
        """Next job, round-robin between uids (caller holds the lock)."""
        while not self._closed:
            job = self._waiting.pop()
            if job is not None:
                return job
            self._lock.wait()
        return None

    # -- workers ----------------------------------------------------------------------

    def _finish(self, job: Job, result: GenerateResult | None, error: BaseException | None) -> None:
        assert job.loop is not None and job.future is not None
        settle_threadsafe(job.loop, job.future, result, error)

    def _work(self) -> None:
        while True:
            with self._lock:
                job = self._take()
                if job is None:
                    return
                self._running.add(job)
            job.started = time.monotonic()
            result: GenerateResult | None
            error: BaseException | None
            try:
                if job.cancelled.is_set():
                    result, error = cancelled_result(), None
                elif job.timed_out:
                    result, error = None, Timeout("the deadline passed while queued")
                else:
                    result = job.run(job)
                    error = None
                    if result.finish_reason == "cancelled" and job.timed_out:
                        result, error = None, Timeout(
                            f"the deadline passed after {len(result.token_ids)} tokens")
            except QvlError as exc:
                result, error = None, exc
            except Exception as exc:  # the server's boundary logs and answers internal
                result, error = None, exc
            finally:
                with self._lock:
                    self._running.discard(job)
                    self._lock.notify_all()
            self._finish(job, result, error)

    # -- shutdown ---------------------------------------------------------------------

    def cancel_all(self) -> int:
        jobs = self.jobs()
        for job in jobs:
            job.cancelled.set()
        return len(jobs)

    async def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every admitted job; True if all finished."""
        deadline = time.monotonic() + timeout
        while self.jobs():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def close(self) -> None:
        """Stop admitting; waiting jobs end cancelled; workers exit after their job."""
        with self._lock:
            self._closed = True
            waiting = self._waiting.clear()
            self._lock.notify_all()
        for job in waiting:
            self._finish(job, cancelled_result(), None)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting),
                    "kv_reserved_bytes": self._reserved_bytes()}

    def _reserved_bytes(self) -> int:
        """KV bytes the admitted jobs may take (lock held)."""
        return sum(j.kv_bytes for j in (*self._running, *self._waiting))
