"""The paged KV cache's bookkeeping: which blocks are free, whose they are, and which hold
a prefix another sequence may reuse. Imports no runtime: the blocks themselves are rows
of the runtime's per-layer cache tensors (``PagedLanguageModel``).

A sequence owns a list of blocks (its block table); row ``i`` of its KV cache is slot
``i % block_size`` of block ``table[i // block_size]``. A block whose rows are all
computed is *full*; full blocks are published under a hash chain — the hash of the
previous block's hash and this block's keys (token id and image digest per row, so
equal hashes mean equal KV rows), and the cache owner (a uid, or None when caches are
shared), so one user's prefix is never another's. A new sequence takes the longest
chain of published blocks matching its prompt, read-only and reference-counted: shared
blocks are never written, because a sequence writes only rows after its matched prefix.
Published blocks nobody holds stay cached, least recently used first in line to be
reused for new rows; unpublished ones go straight back to the free list. A session pins
its history's blocks (held without a sequence), so that LRU eviction passes them by; pins
take at most half the pool and give way, oldest first, when a new sequence needs room.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

# (token id, image digest or None) per row, as ``prompts.prompt_keys`` makes them.
RowKey = tuple[int, bytes | None]


def chain_hashes(keys: Sequence[RowKey], block_size: int, owner: int | None,
                 after: list[bytes] | None = None) -> list[bytes]:
    """The hash of every full block of ``keys``, each covering all rows before it.
    ``after``: the hashes of the first blocks, known already (only the rest are made)."""
    out = list(after or [])
    parent = out[-1] if out else b"qvld-kv" + struct.pack("<q", -1 if owner is None else owner)
    for lo in range(len(out) * block_size, len(keys) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        for token, digest in keys[lo:lo + block_size]:
            h.update(struct.pack("<q", token))
            h.update(digest or b"-")
        parent = h.digest()
        out.append(parent)
    return out


@dataclass
class Lease:
    """One sequence's blocks: the first ``shared`` are a reused prefix (read-only)."""

    blocks: list[int]
    shared: int
    hashes: list[bytes] = field(default_factory=list)  # published so far, in order


class NoBlocks(Exception):
    """Not enough free blocks now (others hold them); retry when one finishes."""


class BlockPool:
    """Allocates, shares and recycles the blocks of one paged KV cache (thread-safe)."""

    def __init__(self, num_blocks: int, block_size: int, retain: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.retain = retain  # keep published blocks after release (a prefix cache)
        self._refs = [0] * num_blocks
        self._pin_refs = [0] * num_blocks  # of _refs, how many are pins
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() -> block 0 first
        self._idle: OrderedDict[int, None] = OrderedDict()  # published, unheld: LRU first
        self._lock = threading.Lock()
        # Pins (a session's history): blocks held on behalf of no running sequence, so
        # that LRU eviction passes them by; oldest first, given up when blocks run short.
        self._pins: OrderedDict[Hashable, list[int]] = OrderedDict()
        self.max_pinned = num_blocks // 2
        self.hits = 0  # rows reused from published blocks
        self.lookups = 0  # prompt rows looked up

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_size)

    def _matched(self, hashes: list[bytes]) -> list[int]:
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, keys: Sequence[RowKey], owner: int | None, rows: int) -> Lease:
        """Blocks for a sequence of ``rows`` rows whose prompt is ``keys``, reusing the
        longest published prefix (``hold_prefix`` then ``grow``). Raises NoBlocks when
        they do not fit now."""
        lease = self.hold_prefix(keys, owner)
        if not self.grow(lease, keys, owner, rows):
            available = self.available()
            self.release(lease)
            raise NoBlocks(f"{self.blocks_for(rows)} blocks needed, {available} free")
        return lease

    def hold_prefix(self, keys: Sequence[RowKey], owner: int | None) -> Lease:
        """Hold the longest published prefix of ``keys`` (never all of it: the last row
        is always fed, for the logits of the next token), taking no new block: what a
        request holds from the moment its images are encoded (those in the prefix are
        not) until the scheduler admits it."""
        hashes = chain_hashes(keys, self.block_size, owner)
        with self._lock:
            matched = self._matched(hashes)
            while matched and len(matched) * self.block_size >= len(keys):
                matched.pop()
            for block in matched:
                self._hold(block)
            self.lookups += len(keys)
            self.hits += len(matched) * self.block_size
            return Lease(blocks=matched, shared=len(matched) * self.block_size,
                         hashes=hashes[:len(matched)])

    def grow(self, lease: Lease, keys: Sequence[RowKey], owner: int | None,
             rows: int, *, spare: int = 0, reuse: bool = True) -> bool:
        """Give ``lease`` blocks for ``rows`` rows: with ``reuse``, first the published
        blocks that continue its prefix along ``keys`` (a preempted sequence finds the
        rows it had computed, unless they were evicted meanwhile; never the last row of
        ``keys``), then fresh ones, leaving ``spare`` blocks for others. False, and the
        lease unchanged, when they do not fit now; the scheduler, the only caller while
        the daemon runs, retries at a later step or preempts."""
        with self._lock:
            more: list[int] = []
            if reuse and len(lease.hashes) == len(lease.blocks):  # a prefix: it may extend
                hashes = chain_hashes(keys, self.block_size, owner, after=lease.hashes)
                more = self._matched(hashes[len(lease.blocks):])
                while more and (len(lease.blocks) + len(more)) * self.block_size >= len(keys):
                    more.pop()
            need = self.blocks_for(rows) - len(lease.blocks) - len(more)
            if need <= 0 and not more:
                return True
            while need + spare > self._available(more) and self._pins:
                self._unpin(next(iter(self._pins)))  # running work before kept histories
            if need + spare > self._available(more):
                return False
            for block in more:
                self._hold(block)
            if more:
                lease.hashes = hashes[:len(lease.blocks) + len(more)]
                lease.blocks += more
                lease.shared = len(lease.blocks) * self.block_size
            lease.blocks += [self._take_free() for _ in range(max(0, need))]
            return True

    def shrink(self, lease: Lease, rows: int) -> None:
        """Give back the lease's blocks after its first ``rows`` rows (a whole number of
        blocks: a preempted sequence keeps its shared prefix). Published blocks stay
        cached, so that it finds them again when it resumes."""
        keep = rows // self.block_size
        with self._lock:
            for block in reversed(lease.blocks[keep:]):
                self._drop(block)
            del lease.blocks[keep:]
            del lease.hashes[keep:]
            lease.shared = min(lease.shared, keep * self.block_size)

    def fits(self, rows: int) -> bool:
        """Whether ``rows`` rows fit the pool at all (when nothing else holds a block)."""
        return self.blocks_for(rows) <= self.num_blocks

    def available(self) -> int:
        """Blocks a new lease could take now."""
        with self._lock:
            return self._available([])

    def _available(self, matched: list[int]) -> int:
        """Blocks a new lease may take (lock held): free ones, and cached ones except
        those it is about to hold as its prefix."""
        return len(self._free) + len(self._idle) - sum(1 for b in matched if b in self._idle)

    def pin(self, name: Hashable, keys: Sequence[RowKey], owner: int | None) -> int:
        """Hold the published blocks of ``keys``' longest cached prefix for ``name`` (a
        session), replacing its earlier pin; the oldest pins give way beyond half the
        pool. Returns the rows pinned."""
        hashes = chain_hashes(keys, self.block_size, owner)
        with self._lock:
            self._unpin(name)
            blocks = self._matched(hashes)
            while self._pins and self._pinned() + len(blocks) > self.max_pinned:
                self._unpin(next(iter(self._pins)))
            if not blocks or len(blocks) > self.max_pinned:
                return 0
            for block in blocks:
                self._hold(block)
                self._pin_refs[block] += 1
            self._pins[name] = blocks
            return len(blocks) * self.block_size

    def unpin(self, name: Hashable) -> None:
        with self._lock:
            self._unpin(name)

    def _pinned(self) -> int:
        return sum(len(blocks) for blocks in self._pins.values())

    def _unpin(self, name: Hashable) -> None:
        for block in self._pins.pop(name, []):
            self._pin_refs[block] -= 1
            self._drop(block)

    def _drop(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block]:
            return
        if block in self._hash_of:
            self._idle[block] = None
        else:
            self._free.append(block)

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._idle.pop(block, None)
        self._refs[block] += 1

    def _take_free(self) -> int:
        if self._free:
            block = self._free.pop()
        else:  # the least recently used cached prefix block gives way
            block, _ = self._idle.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block

    def publish(self, lease: Lease, keys: Sequence[RowKey], owner: int | None,
                rows: int) -> None:
        """Publish the lease's blocks made full by its first ``rows`` rows (whose keys are
        ``keys``), so that later sequences may reuse them."""
        if not self.retain:
            return
        full = min(rows // self.block_size, len(lease.blocks))
        if full <= len(lease.hashes):
            return
        hashes = chain_hashes(keys[:full * self.block_size], self.block_size, owner,
                              after=lease.hashes)
        with self._lock:
            for index in range(len(lease.hashes), full):
                block, h = lease.blocks[index], hashes[index]
                if h not in self._by_hash and block not in self._hash_of:
                    self._by_hash[h] = block
                    self._hash_of[block] = h
            lease.hashes = hashes

    def release(self, lease: Lease) -> None:
        """Give back the lease's blocks: published ones stay cached, the rest are free."""
        with self._lock:
            for block in reversed(lease.blocks):  # the prefix's tail is evicted first
                self._drop(block)
            lease.blocks = []

    def clear(self) -> None:
        """Forget every cached prefix (held blocks stay with their sequences)."""
        with self._lock:
            for block in list(self._idle):
                del self._by_hash[self._hash_of.pop(block)]
                self._free.append(block)
            self._idle.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            held = self._held()
            # Every block is in one of: held (by a running sequence), kept (only by
            # sessions' pins), cached (a published prefix nobody holds) or free.
            kept = sum(1 for r, p in zip(self._refs, self._pin_refs, strict=True)
                       if r and r == p)
            return {"blocks": self.num_blocks, "block_size": self.block_size,
                    "held": held, "kept": kept, "pinned": self._pinned(),
                    "cached": len(self._idle), "free": len(self._free),
                    "hit_rows": self.hits, "lookup_rows": self.lookups}

    def usage_ratio(self) -> float:
        """Blocks held by running sequences, 0-1 (cached prefixes count as free)."""
        with self._lock:
            return self._held() / self.num_blocks if self.num_blocks else 0.0

    def _held(self) -> int:
        """Blocks running sequences hold (pinned ones only by pins are not counted)."""
        return sum(1 for r, p in zip(self._refs, self._pin_refs, strict=True) if r > p)
