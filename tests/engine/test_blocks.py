"""The paged KV cache's block bookkeeping (no runtime needed: it is plain Python)."""

from __future__ import annotations

import pytest

from qvld.engine.loop.blocks import BlockPool, NoBlocks, chain_hashes

IMG = b"\x01" * 32


def keys(*tokens: int, image: bytes | None = None) -> list[tuple[int, bytes | None]]:
    return [(t, image) for t in tokens]


def test_chain_hashes_cover_every_row_before_them_and_the_owner() -> None:
    a = chain_hashes(keys(*range(8)), 4, owner=1)
    assert len(a) == 2 and len(chain_hashes(keys(*range(7)), 4, owner=1)) == 1
    b = chain_hashes(keys(9, *range(1, 8)), 4, owner=1)
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes block 1's hash
    assert chain_hashes(keys(*range(8)), 4, owner=2) != a
    assert chain_hashes(keys(*range(8), image=IMG), 4, owner=1) != a  # image content counts


def test_a_published_prefix_is_shared_read_only_and_never_the_last_row() -> None:
    pool = BlockPool(16, 4)
    prompt = keys(*range(10))
    first = pool.acquire(prompt, 1, rows=12)
    assert first.shared == 0 and len(first.blocks) == 3
    pool.publish(first, prompt, 1, rows=10)  # two full blocks
    second = pool.acquire(prompt, 1, rows=12)
    assert second.shared == 8 and second.blocks[:2] == first.blocks[:2]
    assert second.blocks[2] != first.blocks[2]
    # A prompt of exactly two blocks reuses one: its last row is fed again.
    exact = pool.acquire(prompt[:8], 1, rows=9)
    assert exact.shared == 4
    assert pool.acquire(prompt, 2, rows=12).shared == 0  # another owner
    assert pool.stats()["held"] == 3 + 1 + 2 + 3  # shared blocks are held once


def test_released_blocks_stay_cached_until_needed_least_recently_used_first() -> None:
    pool = BlockPool(4, 2)
    a, b = keys(1, 2, 3), keys(5, 6, 7)
    lease_a = pool.acquire(a, 1, rows=4)
    pool.publish(lease_a, a, 1, rows=3)
    pool.release(lease_a)
    lease_b = pool.acquire(b, 1, rows=4)
    pool.publish(lease_b, b, 1, rows=3)
    pool.release(lease_b)
    assert pool.stats()["cached"] == 2 and pool.stats()["free"] == 2
    big = pool.acquire(keys(9), 1, rows=6)  # two free blocks, then a's (older) cached one
    assert len(big.blocks) == 3
    pool.release(big)
    again_b = pool.acquire(b, 1, rows=3)
    assert again_b.shared == 2  # still cached
    pool.release(again_b)
    assert pool.acquire(a, 1, rows=3).shared == 0  # evicted


def test_blocks_that_do_not_fit_leave_the_lease_as_it_was() -> None:
    pool = BlockPool(4, 2, retain=False)
    lease = pool.acquire(keys(1), 1, rows=8)
    with pytest.raises(NoBlocks):
        pool.acquire(keys(2), 1, rows=2)
    assert not pool.fits(10) and pool.fits(8)  # more than the whole pool: never fits
    waiting = pool.hold_prefix(keys(2), 1)
    assert waiting.blocks == [] and not pool.grow(waiting, keys(2), 1, rows=2)
    assert waiting.blocks == [] and pool.available() == 0
    pool.release(lease)
    assert pool.grow(waiting, keys(2), 1, rows=2) and len(waiting.blocks) == 1
    assert pool.stats()["cached"] == 0  # retain=False: nothing kept


def test_a_shrunk_lease_keeps_its_prefix_and_finds_its_published_rows_again() -> None:
    """Preemption by recompute: the blocks after the shared prefix go back, the full
    ones stay cached, and growing again reuses them (never the last row of the keys)."""
    pool = BlockPool(8, 2)
    prompt = keys(*range(6))
    first = pool.acquire(prompt, 1, rows=6)
    pool.publish(first, prompt, 1, rows=6)
    pool.release(first)
    lease = pool.hold_prefix(prompt + keys(7, 8, 9), 1)  # three cached blocks
    assert lease.shared == 6
    held = prompt + keys(7, 8, 9, 10)
    assert pool.grow(lease, held, 1, rows=12) and len(lease.blocks) == 6
    pool.publish(lease, held, 1, rows=10)  # five full blocks now
    pool.shrink(lease, 6)
    assert len(lease.blocks) == 3 and lease.shared == 6
    assert pool.stats()["cached"] == 2  # blocks 4 and 5: published, given back
    assert pool.grow(lease, held, 1, rows=12)
    assert lease.shared == 8  # block 4 found again; block 5 holds the last row
    assert len(lease.blocks) == 6 and pool.stats()["held"] == 6
    pool.release(lease)
    assert pool.stats()["held"] == 0


def test_usage_ratio_counts_held_blocks_only() -> None:
    pool = BlockPool(8, 2)
    prompt = keys(1, 2, 3, 4, 5)
    lease = pool.acquire(prompt, None, rows=8)
    assert pool.usage_ratio() == 0.5
    pool.publish(lease, prompt, None, rows=5)
    pool.release(lease)
    assert pool.usage_ratio() == 0.0 and pool.stats()["cached"] == 2
    pool.clear()
    assert pool.stats()["free"] == 8


def cache(pool: BlockPool, prompt: list[tuple[int, bytes | None]], owner: int = 1) -> None:
    lease = pool.acquire(prompt, owner, rows=len(prompt))
    pool.publish(lease, prompt, owner, rows=len(prompt))
    pool.release(lease)


def test_a_pinned_history_survives_eviction_until_room_is_needed() -> None:
    pool = BlockPool(6, 2)
    history = keys(1, 2, 3, 4, 5)
    cache(pool, history)
    assert pool.pin(("uid", "s"), history, 1) == 4  # two full blocks
    assert pool.stats()["pinned"] == 2 and pool.stats()["held"] == 0
    stats = pool.stats()  # every block in exactly one state
    assert stats["kept"] == 2
    assert stats["held"] + stats["kept"] + stats["cached"] + stats["free"] == 6
    for n in range(3):  # other traffic cycles through every unpinned block
        cache(pool, keys(10 + n, 20 + n, 30 + n, 40 + n))
    follow_up = pool.acquire(history + keys(6), 1, rows=8)
    assert follow_up.shared == 4  # the pinned prefix was still there
    pool.release(follow_up)
    # A sequence needing every block makes the pin give way rather than wait forever.
    big = pool.acquire(keys(99), 1, rows=12)
    assert len(big.blocks) == 6 and pool.stats()["pinned"] == 0


def test_pins_are_bounded_and_let_go_by_name() -> None:
    pool = BlockPool(8, 2)  # at most 4 blocks pinned
    first, second = keys(1, 2, 3, 4, 5), keys(6, 7, 8, 9, 10)
    cache(pool, first)
    cache(pool, second)
    pool.pin("a", first, 1)
    pool.pin("b", second, 1)
    assert pool.stats()["pinned"] == 4
    third = keys(11, 12, 13, 14, 15)
    cache(pool, third)
    pool.pin("c", third, 1)  # the oldest pin gives way
    assert pool.stats()["pinned"] == 4
    pool.unpin("b")
    assert pool.stats()["pinned"] == 2
    pool.unpin("c")
    assert pool.stats()["pinned"] == 0 and pool.stats()["cached"] == 6
