"""The per-user round-robin queue and the fair-share bound every queue uses."""

from __future__ import annotations

from qvld.fairqueue import FairQueue, within_share


def test_round_robin_between_users_and_counts_per_user() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3"):
        queue.push(1, item)
    queue.push(2, "b1")
    assert (queue.count(1), queue.count(2), queue.count(3)) == (3, 1, 0)
    assert [queue.pop() for _ in range(4)] == ["a1", "b1", "a2", "a3"]
    assert queue.pop() is None and queue.uids() == []


def test_anyone_may_queue_while_there_is_room() -> None:
    assert within_share(total=3, held=3, others=0, asked=1, capacity=4)
    assert not within_share(total=4, held=4, others=0, asked=1, capacity=4)  # alone, full


def test_a_full_queue_makes_only_the_user_past_its_share_busy() -> None:
    # Alice fills a queue of 8; Bob, holding none, still gets in; Alice does not.
    assert within_share(total=8, held=0, others=1, asked=1, capacity=8)
    assert not within_share(total=8, held=8, others=0, asked=1, capacity=8)
    # With Bob in, the share is 4 each: his fourth gets in, his fifth does not.
    assert within_share(total=11, held=3, others=1, asked=1, capacity=8)
    assert not within_share(total=12, held=4, others=1, asked=1, capacity=8)


def test_choices_count_each() -> None:
    # n=16 asks for 16 entries: past a share of 4 even for a user holding none.
    assert not within_share(total=8, held=0, others=1, asked=16, capacity=8)
    assert within_share(total=8, held=0, others=1, asked=4, capacity=8)


def test_no_queue_means_no_queue() -> None:
    assert not within_share(total=0, held=0, others=0, asked=1, capacity=0)
