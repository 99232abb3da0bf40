"""The scheduler with real worker threads; jobs are small functions standing in for
generations (the daemon tests run it with the engine)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest

from qvld.engine.types import GenerateResult, Timings, Usage
from qvld.errors import BadRequest, Busy, Timeout, Unavailable
from qvld.scheduler import Job, Scheduler


def result(reason: str = "length") -> GenerateResult:
    return GenerateResult(text="", token_ids=[1], finish_reason=reason,  # type: ignore[arg-type]
                          usage=Usage(), timings=Timings())


def sleeper(seconds: float, log: list[int] | None = None, tag: int = 0
            ) -> Callable[[Job], GenerateResult]:
    def run(job: Job) -> GenerateResult:
        if log is not None:
            log.append(tag)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if job.should_stop():
                return result("cancelled")
            time.sleep(0.005)  # the stand-in job's work: it checks should_stop as a step would
        return result()
    return run


def job(uid: int, run: Callable[[Job], GenerateResult], deadline_s: float = 30,
        kv: int = 0) -> Job:
    return Job(uid=uid, run=run, deadline=time.monotonic() + deadline_s, kv_bytes=kv)


async def settled(scheduler: Scheduler, running: int, waiting: int = 0,
                  timeout: float = 10) -> None:
    """Until exactly ``running`` jobs run and ``waiting`` wait (the submits got there)."""
    deadline = time.monotonic() + timeout
    while (scheduler.running, scheduler.waiting) != (running, waiting):
        assert time.monotonic() < deadline, (
            f"not within {timeout} s: {running} running and {waiting} waiting "
            f"(now {scheduler.running} and {scheduler.waiting})")
        await asyncio.sleep(0.005)  # the polling interval


def test_round_robin_between_uids() -> None:
    async def scenario() -> list[int]:
        order: list[int] = []
        scheduler = Scheduler(workers=1, queue_max=10, kv_budget_bytes=None)
        gate = threading.Event()

        def blocker(job: Job) -> GenerateResult:
            gate.wait(5)
            return result()

        first = asyncio.ensure_future(scheduler.submit(job(1, blocker)))
        await settled(scheduler, running=1)
        tasks = [asyncio.ensure_future(scheduler.submit(job(1, sleeper(0.01, order, 1))))
                 for _ in range(3)]
        tasks.append(asyncio.ensure_future(scheduler.submit(job(2, sleeper(0.01, order, 2)))))
        await settled(scheduler, running=1, waiting=4)
        gate.set()
        await asyncio.gather(first, *tasks)
        scheduler.close()
        return order

    # uid 2 arrived last but runs right after uid 1's first waiting job.
    assert asyncio.run(scenario()) == [1, 2, 1, 1]


def test_queue_limit_and_memory_budget_answer_busy() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(workers=1, queue_max=1, kv_budget_bytes=100)
        running = asyncio.ensure_future(scheduler.submit(job(1, sleeper(0.3), kv=10)))
        await settled(scheduler, running=1)
        waiting = asyncio.ensure_future(scheduler.submit(job(1, sleeper(0.01), kv=10)))
        await settled(scheduler, running=1, waiting=1)
        with pytest.raises(Busy):  # one running, one waiting: queue_max reached
            await scheduler.submit(job(2, sleeper(0.01)))
        await asyncio.gather(running, waiting)
        with pytest.raises(BadRequest):  # more than the whole budget: never retryable
            await scheduler.submit(job(1, sleeper(0.01), kv=101))
        big = asyncio.ensure_future(scheduler.submit(job(1, sleeper(0.2), kv=80)))
        await settled(scheduler, running=1)
        with pytest.raises(Busy, match="taken"):
            await scheduler.submit(job(1, sleeper(0.01), kv=30))
        await big
        assert (await scheduler.submit(job(1, sleeper(0.01), kv=30))).finish_reason == "length"
        scheduler.close()

    asyncio.run(scenario())


def test_a_request_larger_than_the_whole_kv_budget_is_refused_not_busy() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(workers=1, queue_max=5, kv_budget_bytes=64 << 20)
        with pytest.raises(BadRequest, match=r"needs 96\.0 MiB .*budget of 64\.0 MiB") as exc:
            await scheduler.submit(job(1, sleeper(0.01), kv=96 << 20))
        assert not exc.value.retryable and exc.value.to_wire()["retryable"] is False
        assert scheduler.waiting == 0
        scheduler.close()

    asyncio.run(scenario())


def test_cancel_ends_a_waiting_job_at_once_and_a_running_one_within_a_step() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(workers=1, queue_max=5, kv_budget_bytes=None)
        running_job = job(1, sleeper(5))
        running = asyncio.ensure_future(scheduler.submit(running_job))
        await settled(scheduler, running=1)
        waiting_job = job(1, sleeper(5))
        waiting = asyncio.ensure_future(scheduler.submit(waiting_job))
        await settled(scheduler, running=1, waiting=1)
        t0 = time.monotonic()
        scheduler.cancel(waiting_job)
        assert (await waiting).finish_reason == "cancelled"
        scheduler.cancel(running_job)
        assert (await running).finish_reason == "cancelled"
        assert time.monotonic() - t0 < 1.0
        scheduler.close()

    asyncio.run(scenario())


def test_deadlines_while_waiting_and_while_running() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(workers=1, queue_max=5, kv_budget_bytes=None)
        with pytest.raises(Timeout, match="after"):
            await scheduler.submit(job(1, sleeper(5), deadline_s=0.1))
        blocker = asyncio.ensure_future(scheduler.submit(job(1, sleeper(0.5))))
        await settled(scheduler, running=1)
        with pytest.raises(Timeout, match="queued"):
            await scheduler.submit(job(2, sleeper(0.01), deadline_s=0.1))
        await blocker
        scheduler.close()

    asyncio.run(scenario())


def test_close_cancels_waiting_jobs_and_refuses_new_ones() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(workers=1, queue_max=5, kv_budget_bytes=None)
        running = asyncio.ensure_future(scheduler.submit(job(1, sleeper(0.2))))
        await settled(scheduler, running=1)
        waiting = asyncio.ensure_future(scheduler.submit(job(1, sleeper(0.2))))
        await settled(scheduler, running=1, waiting=1)
        scheduler.close()
        assert (await waiting).finish_reason == "cancelled"
        assert (await running).finish_reason == "length"
        with pytest.raises(Unavailable):
            await scheduler.submit(job(1, sleeper(0.01)))

    asyncio.run(scenario())


def test_a_failing_job_does_not_kill_its_worker() -> None:
    async def scenario() -> None:
        scheduler = Scheduler(workers=1, queue_max=5, kv_budget_bytes=None)

        def boom(job: Job) -> GenerateResult:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            await scheduler.submit(job(1, boom))
        assert (await scheduler.submit(job(1, sleeper(0.01)))).finish_reason == "length"
        scheduler.close()

    asyncio.run(scenario())
