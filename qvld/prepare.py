"""The prepare stage: decoding images and tokenising, before the fair queue's admission.

Prepare work is CPU-heavy (an 8000×8000 PNG takes seconds to decode), so it runs on a
few threads, and like the generation queue it is shared fairly: waiting items are taken
round-robin between uids, and one uid runs on at most ``workers - 1`` threads while
others could want one, so three requests of huge images from one user (measured: 20 s of
decoding) do not hold every thread when another user's small request arrives; and work
decoding images or video runs on at most ``workers - 1`` threads in all, so that several
users' clips at once never make a text request wait behind their decoding. An item
whose client left or whose
deadline passed while it waited is dropped without running (its waiter is answered at
once); one already running stops between images (the engine polls ``should_stop``). At
most ``queue_max`` items (plus one per thread) wait; more are ``busy``, but only for a
user holding its fair share of them (``fairqueue.within_share``): one user's flood never
makes another user busy.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qvld.config import Config
from qvld.errors import Busy, Timeout, Unavailable
from qvld.fairqueue import FairQueue, settle_threadsafe, within_share


class PrepareCancelled(Exception):
    """The item was cancelled (its client left or asked) before it was prepared."""


@dataclass(eq=False)
class Ticket:
    uid: int
    work: Callable[[], Any]
    deadline: float  # time.monotonic()
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    cancelled: bool = False
    started: float | None = None
    enqueued: float = field(default_factory=time.monotonic)
    media: bool = False  # images or video to decode: seconds of work, not milliseconds


class PrepareStage:
    def __init__(self, workers: int = 2, queue_max: int = 32) -> None:
        self.queue_max = queue_max
        self._lock = threading.Condition()
        self._waiting: FairQueue[Ticket] = FairQueue()
        self._running: collections.Counter[int] = collections.Counter()
        # One thread stays free for other uids (unless there is only one), and one for
        # requests without images or video: users' large pictures or clips at once never
        # make a text request wait behind their decoding.
        self.per_uid = max(1, workers - 1)
        self.media_threads = max(1, workers - 1)
        self._media_running = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"qvld-prepare-{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def reconfigure(self, config: Config) -> None:
        """A reload's queue bound."""
        with self._lock:
            self.queue_max = config.server.prepare_queue_max

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    def submit(self, uid: int, work: Callable[[], Any], deadline: float,
               media: bool = False) -> Ticket:
        """Queue ``work`` for ``uid`` (call from the event loop); ``media``: it decodes
        images or video."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(uid, work, deadline, loop, loop.create_future(), media=media)
        with self._lock:
            if self._closed:
                raise Unavailable("the daemon is shutting down")
            # Up to queue_max wait beyond what the threads are about to take, each
            # user's share kept for it (a flooding user is the only one made busy).
            held = self._waiting.count(uid)
            others = sum(1 for u in self._waiting.uids() if u != uid)
            if not within_share(total=len(self._waiting), held=held, others=others,
                                asked=1, capacity=self.queue_max + len(self._threads)):
                raise Busy("too many requests are waiting to be prepared, this user's "
                           f"share ({held}) among them; retry shortly")
            self._waiting.push(uid, ticket)
            self._lock.notify()
        return ticket

    async def result(self, ticket: Ticket) -> Any:
        """The prepared value; ``Timeout`` at the deadline if it has not started by then,
        ``PrepareCancelled`` once cancelled while waiting."""
        remaining = max(0.0, ticket.deadline - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.shield(ticket.future), remaining)
        except asyncio.TimeoutError:
            if self._unqueue(ticket):
                raise Timeout("the deadline passed before the request was prepared") \
                    from None
            return await ticket.future  # running: it stops at the next image

    def cancel(self, ticket: Ticket) -> None:
        """A waiting item ends now; a running one stops between images (``should_stop``
        of the request is the caller's to set)."""
        ticket.cancelled = True
        if self._unqueue(ticket) and not ticket.future.done():
            ticket.future.set_exception(PrepareCancelled())

    def _unqueue(self, ticket: Ticket) -> bool:
        with self._lock:
            return self._waiting.remove(ticket.uid, ticket)

    def _take(self) -> Ticket | None:
        """The next item, round-robin between the uids under their share of threads
        (lock held)."""
        def eligible(uid: int) -> bool:
            head = self._waiting.peek(uid)
            return self._running[uid] < self.per_uid and (
                head is None or not head.media or self._media_running < self.media_threads)

        while not self._closed:
            ticket = self._waiting.pop(eligible)
            if ticket is not None:
                self._running[ticket.uid] += 1
                self._media_running += ticket.media
                return ticket
            self._lock.wait()
        return None

    def _work(self) -> None:
        while True:
            with self._lock:
                ticket = self._take()
                if ticket is None:
                    return
            ticket.started = time.monotonic()
            value: Any = None
            error: BaseException | None = None
            try:
                if ticket.cancelled:
                    error = PrepareCancelled()
                elif time.monotonic() >= ticket.deadline:
                    error = Timeout("the deadline passed before the request was prepared")
                else:
                    value = ticket.work()
            except Exception as exc:  # the server's boundary logs and answers internal
                error = exc
            finally:
                with self._lock:
                    self._media_running -= ticket.media
                    self._running[ticket.uid] -= 1
                    if not self._running[ticket.uid]:
                        del self._running[ticket.uid]
                    self._lock.notify_all()  # the uid may take another thread now
            settle_threadsafe(ticket.loop, ticket.future, value, error)

    def close(self) -> None:
        """Stop taking work; waiting items end cancelled."""
        with self._lock:
            self._closed = True
            waiting = self._waiting.clear()
            self._lock.notify_all()
        for ticket in waiting:
            settle_threadsafe(ticket.loop, ticket.future, None, PrepareCancelled())
