"""The prepare stage on its own: fair between uids, bounded, cancellable, deadline-aware."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from qvld.errors import Busy, Timeout
from qvld.prepare import PrepareCancelled, PrepareStage


async def until(condition: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.005)


def blocker() -> tuple[threading.Event, Any]:
    release = threading.Event()

    def work() -> str:
        assert release.wait(10)
        return "slow"

    return release, work


def test_one_uid_leaves_a_thread_for_the_others() -> None:
    async def scenario() -> list[str]:
        stage = PrepareStage(workers=2, queue_max=8)
        release, slow = blocker()
        order: list[str] = []
        far = time.monotonic() + 30
        hog = [stage.submit(0, slow, far) for _ in range(3)]  # uid 0: one runs, two wait
        other = stage.submit(1, lambda: "quick", far)
        order.append(await stage.result(other))  # served while uid 0's first still runs
        assert not any(t.future.done() for t in hog)
        release.set()
        order += [await stage.result(t) for t in hog]
        stage.close()
        return order

    assert asyncio.run(scenario()) == ["quick", "slow", "slow", "slow"]


def test_round_robin_between_waiting_uids() -> None:
    async def scenario() -> list[int]:
        stage = PrepareStage(workers=1, queue_max=16)
        release, slow = blocker()
        far = time.monotonic() + 30
        first = stage.submit(9, slow, far)
        done: list[int] = []

        def record(uid: int) -> Any:
            return lambda: done.append(uid)

        tickets = [stage.submit(uid, record(uid), far) for uid in (0, 0, 0, 1, 2)]
        release.set()
        await stage.result(first)
        for ticket in tickets:
            await stage.result(ticket)
        stage.close()
        return done

    assert asyncio.run(scenario()) == [0, 1, 2, 0, 0]


def test_waiting_items_end_at_cancel_and_deadline_without_running() -> None:
    async def scenario() -> None:
        stage = PrepareStage(workers=1, queue_max=8)
        release, slow = blocker()
        running = stage.submit(0, slow, time.monotonic() + 30)
        ran: list[str] = []
        cancelled = stage.submit(1, lambda: ran.append("cancelled"), time.monotonic() + 30)
        late = stage.submit(2, lambda: ran.append("late"), time.monotonic() + 0.2)
        stage.cancel(cancelled)
        with pytest.raises(PrepareCancelled):
            await stage.result(cancelled)
        t0 = time.monotonic()
        with pytest.raises(Timeout):
            await stage.result(late)
        assert time.monotonic() - t0 < 1.0  # at its deadline, not when a thread frees
        release.set()
        assert await stage.result(running) == "slow"
        # One worker, taking items in order: once a later item is done, the two before
        # it were either run or dropped.
        assert await stage.result(stage.submit(3, lambda: "after", time.monotonic() + 30)) \
            == "after"
        assert ran == []  # neither was ever run
        stage.close()

    asyncio.run(scenario())


def test_busy_beyond_the_queue_and_close_ends_the_waiting() -> None:
    async def scenario() -> None:
        stage = PrepareStage(workers=1, queue_max=1)
        release, slow = blocker()
        far = time.monotonic() + 30
        stage.submit(0, slow, far)
        await until(lambda: stage.waiting == 0)  # taken by the worker: no longer waiting
        waiting = [stage.submit(1, lambda: None, far) for _ in range(2)]
        with pytest.raises(Busy):  # uid 1 filled the queue
            stage.submit(1, lambda: None, far)
        # uid 2, holding none, gets its share (1 of 2) of the full queue; not more.
        waiting.append(stage.submit(2, lambda: None, far))
        with pytest.raises(Busy, match="share"):
            stage.submit(2, lambda: None, far)
        stage.close()
        for ticket in waiting:
            with pytest.raises(PrepareCancelled):
                await stage.result(ticket)
        release.set()

    asyncio.run(scenario())


def test_decoding_media_never_takes_the_thread_a_text_request_needs() -> None:
    """#46: two users' video bombs held both prepare threads, and a third user's plain
    text request waited 37.4 s. Work decoding images or video runs on at most all
    threads but one, whoever sends it."""
    async def scenario() -> None:
        stage = PrepareStage(workers=2, queue_max=8)
        release, slow = blocker()
        far = time.monotonic() + 30
        clips = [stage.submit(uid, slow, far, media=True) for uid in (1, 2)]
        await until(lambda: stage.waiting == 1)  # one decodes, the other waits its turn
        t0 = time.monotonic()
        assert await stage.result(stage.submit(3, lambda: "text", far)) == "text"
        assert time.monotonic() - t0 < 5 and not any(c.future.done() for c in clips)
        release.set()
        assert [await stage.result(c) for c in clips] == ["slow", "slow"]
        stage.close()

    asyncio.run(scenario())
