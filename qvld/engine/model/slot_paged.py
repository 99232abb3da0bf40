"""The paged model for a runtime that runs one sequence per inference: the step loop's
one generation path on every backend.

OpenVINO's paged-attention language model runs every scheduled sequence's rows in one
inference over a shared block cache. ONNX Runtime's exported graph (and OpenVINO's
stateful one, ``engine.continuous_batching: false``) holds one sequence's KV cache per
slot instead. ``SlotPaged`` puts those slots behind the same ``PagedModel`` seam: the
KV rows live in blocks here (numpy, f32, ``[blocks, kv heads, BLOCK_ROWS, head dim]``
per layer's keys and values), so the step loop, the scheduler, the block pool's prefix
cache, sessions and preemption are the same code whatever runtime runs the model.

A step feeds each scheduled sequence on a slot in turn (each inference uses every
core). A slot remembers which blocks, at which version, its cache mirrors: a sequence
that stepped last time on a slot steps there again without copying (one user decoding
pays one row's copy-out per step); any other slot first loads the sequence's rows from
its blocks (``RowsSlot.load_rows``). The rows a step computed are written back to the
sequence's blocks at once, so the blocks are always the truth: a prefix another
sequence shares, a preempted sequence's recompute, a reader (``read_rows``) all see them.
Every write bumps the block's version, which is how a slot learns its mirror is stale.

Memory: the blocks (``engine.kv_cache_mb``) plus each slot's own copy of the sequence
it last ran (at most the context each). Time: ONNX Runtime's rows are read out as views
(one row copied per decode step); OpenVINO's stateful model gives no view of its
state, so reading a step's rows out converts its whole cache (O(context) per step, in
a mode that is not the default).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qvld.engine.model.interface import BatchSlot, RowsSlot

# Rows per block: the OpenVINO CPU plugin's paged-attention block size, so that one
# kv_cache_mb holds about as many rows whichever executor runs.
BLOCK_ROWS = 32


@dataclass
class KvLayout:
    """One position's KV cache as a runtime lays it out: ``caches`` arrays (keys then
    values of each layer), each ``[heads, head_dim]`` per row."""

    caches: int
    heads: int
    head_dim: int

    @property
    def bytes_per_token(self) -> int:
        return self.caches * self.heads * self.head_dim * 4  # f32


@dataclass(eq=False)
class _Held:
    """What a runtime's cache holds of one sequence: rows [0, length) of the blocks
    ``blocks`` as they were at ``versions``."""

    blocks: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    length: int = 0

    def valid_rows(self, blocks: np.ndarray, rows: int, current: np.ndarray) -> int:
        """How many of a sequence's first ``rows`` rows (its block table ``blocks``) this
        cache holds as they are now."""
        held = min(self.length, rows)
        count = -(-held // BLOCK_ROWS)
        for i in range(count):
            if (i >= len(blocks) or self.blocks[i] != blocks[i]
                    or self.versions[i] != current[blocks[i]]):
                return i * BLOCK_ROWS
        return held

    def holds(self, blocks: np.ndarray, rows: int, current: np.ndarray) -> bool:
        """Whether this cache holds exactly a sequence's ``rows`` rows, as they are now."""
        return self.length == rows and self.valid_rows(blocks, rows, current) == rows

    def record(self, blocks: np.ndarray, length: int, current: np.ndarray) -> None:
        used = -(-length // BLOCK_ROWS)
        self.blocks = [int(b) for b in blocks[:used]]
        self.versions = [int(current[b]) for b in self.blocks]
        self.length = length

    def forget(self) -> None:
        self.blocks, self.versions, self.length = [], [], 0


class _Mirror(_Held):
    """One slot's cache: one sequence's rows."""

    def __init__(self, slot: RowsSlot) -> None:
        super().__init__()
        self.slot = slot
        self.used = 0  # when it last stepped (SlotPaged's step count)


@dataclass(eq=False)
class _Lane:
    """The decode lane: several sequences' caches side by side in one slot's batch
    (``BatchSlot``), each at its own length; the slot writes each step's new row after
    each one's rows, and positions are explicit inputs."""

    slot: BatchSlot
    members: list[_Held] = field(default_factory=list)

    def order_of(self, tables: list[np.ndarray], pasts: list[int],
                 current: np.ndarray) -> list[int] | None:
        """The member each sequence is (its batch row), or None unless the lane holds
        exactly these sequences as they are now."""
        if len(tables) != len(self.members):
            return None
        free = set(range(len(self.members)))
        order = []
        for blocks, past in zip(tables, pasts, strict=True):
            row = next((m for m in free if self.members[m].holds(blocks, past, current)), None)
            if row is None:
                return None
            free.discard(row)
            order.append(row)
        return order


class SlotPaged:
    """``PagedModel`` over ``slots`` (``RowsSlot``s of one runtime) and a block store of
    its own. Only the step thread calls ``step``; ``read_rows``/``write_rows`` are
    called from the same thread or while the sequence is outside the loop (its own,
    unshared blocks only)."""

    rows_accessible = True

    def __init__(self, new_slot: Callable[[], RowsSlot], slots: int, num_blocks: int,
                 layout: KvLayout, lane: BatchSlot | None = None) -> None:
        """``lane``: a slot that steps a batch of sequences at once (``BatchSlot``): every
        scheduled one-row step then runs in one inference there (one pass over the
        weights for all decoding sequences), the rest on ``slots`` slots in turn."""
        self.block_size = BLOCK_ROWS
        self.num_blocks = num_blocks
        self.layout = layout
        # np.zeros maps untouched pages lazily: blocks cost memory once written.
        self._caches = [np.zeros((num_blocks, layout.heads, BLOCK_ROWS, layout.head_dim),
                                 np.float32) for _ in range(layout.caches)]
        self.cache_bytes = sum(cache.nbytes for cache in self._caches)
        self._versions = np.zeros(num_blocks, np.int64)
        self._mirrors = [_Mirror(new_slot()) for _ in range(max(1, slots))]
        self._lane = None if lane is None else _Lane(lane)
        self.batches_decoding = lane is not None
        self.busy_since: float | None = None
        self.reloads = 0  # sequences loaded into a slot from their blocks
        self.lane_loads = 0  # times the decode lane was filled from the blocks
        self._clock = 0

    # -- the block store ------------------------------------------------------------

    def _spans(self, blocks: list[int] | np.ndarray, start: int, count: int
               ) -> list[tuple[int, int, int, int]]:
        """(block, first row in it, rows, offset into the span) covering rows
        [start, start + count) of a sequence whose block table is ``blocks``."""
        spans, row = [], start
        while row < start + count:
            n = min(BLOCK_ROWS - row % BLOCK_ROWS, start + count - row)
            spans.append((int(blocks[row // BLOCK_ROWS]), row % BLOCK_ROWS, n, row - start))
            row += n
        return spans

    def read_rows(self, blocks: list[int] | np.ndarray, count: int) -> list[np.ndarray]:
        """A sequence's first ``count`` rows: f32 [1, heads, count, head_dim] per cache."""
        spans = self._spans(blocks, 0, count)
        out = []
        for cache in self._caches:
            rows = np.empty((1, cache.shape[1], count, cache.shape[3]), np.float32)
            for block, lo, n, at in spans:
                rows[0, :, at:at + n] = cache[block, :, lo:lo + n]
            out.append(rows)
        return out

    def write_rows(self, blocks: list[int] | np.ndarray, start: int,
                   kv: list[np.ndarray]) -> None:
        """Store rows [start, start + n) of a sequence (``read_rows``' layout)."""
        spans = self._spans(blocks, start, kv[0].shape[2])
        for cache, rows in zip(self._caches, kv, strict=True):
            for block, lo, n, at in spans:
                cache[block, :, lo:lo + n] = rows[0, :, at:at + n]
        for block, _, _, _ in spans:
            self._versions[block] += 1

    # -- the step --------------------------------------------------------------------

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self._mirrors[0].slot.embed(ids)

    def no_deepstack(self) -> np.ndarray:
        return self._mirrors[0].slot.no_deepstack()

    def _slot_for(self, blocks: np.ndarray, past: int, taken: set[int]) -> _Mirror:
        """A slot holding the sequence's first ``past`` rows: one that holds them
        already (cut back to them), else the least recently used one not yet used this
        step, loaded from the blocks."""
        free = [m for i, m in enumerate(self._mirrors) if i not in taken]
        if past:
            holding = [m for m in free if m.valid_rows(blocks, past, self._versions) == past]
            if holding:
                mirror = max(holding, key=lambda m: m.used)
                if mirror.length > past:
                    mirror.slot.trim(past)
                return mirror
        mirror = min(free, key=lambda m: m.used)
        mirror.forget()
        if past:
            mirror.slot.load_rows(self.read_rows(blocks, past))
            self.reloads += 1
        else:
            mirror.slot.reset()
        return mirror

    def step(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
             deepstack: np.ndarray, past_lens: np.ndarray, begins: np.ndarray,
             block_begins: np.ndarray, block_indices: np.ndarray) -> np.ndarray:
        """``PagedModel.step``: each sequence's rows on a slot, in turn; the logits of
        each one's last row [S, V]."""
        self.busy_since = time.monotonic()
        try:
            return self._step(embeds, positions, visual_mask, deepstack, past_lens, begins,
                              block_begins, block_indices)
        finally:
            self.busy_since = None

    def _step(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
              deepstack: np.ndarray, past_lens: np.ndarray, begins: np.ndarray,
              block_begins: np.ndarray, block_indices: np.ndarray) -> np.ndarray:
        count = len(past_lens)
        tables = [block_indices[block_begins[i]:block_begins[i + 1]] for i in range(count)]
        rows = np.diff(begins)
        # One-row steps without image rows (decoding) go to the lane, all in one inference.
        laned = [] if self._lane is None else [
            i for i in range(count) if rows[i] == 1 and not visual_mask[begins[i]]]
        # Where each sequence's visual rows start in the packed deepstack.
        visual_before = np.concatenate([[0], np.cumsum(visual_mask)])
        out: np.ndarray | None = None
        taken: set[int] = set()
        for i in sorted(set(range(count)) - set(laned)):
            lo, hi = int(begins[i]), int(begins[i + 1])
            past = int(past_lens[i])
            blocks = tables[i]
            if len(taken) == len(self._mirrors):
                taken = set()  # more sequences than slots: slots are reused in turn
            mirror = self._slot_for(blocks, past, taken)
            taken.add(self._mirrors.index(mirror))
            mask = visual_mask[lo:hi]
            v0, v1 = int(visual_before[lo]), int(visual_before[hi])
            rows_deepstack = deepstack[:, v0:v1] if v1 > v0 else mirror.slot.no_deepstack()
            logits = mirror.slot.step(embeds[lo:hi], positions[:, lo:hi], mask,
                                      rows_deepstack)
            if out is None:
                out = np.empty((count, logits.shape[-1]), np.float32)
            out[i] = logits
            total = past + hi - lo
            self.write_rows(blocks, past, mirror.slot.rows_from(past))
            mirror.record(blocks, total, self._versions)
            self._clock += 1
            mirror.used = self._clock
        if laned:
            logits = self._lane_step(laned, embeds, positions, past_lens, begins, tables)
            if out is None:
                out = np.empty((count, logits.shape[-1]), np.float32)
            out[laned] = logits
        assert out is not None, "a step feeds at least one sequence"
        return out

    def _lane_step(self, laned: list[int], embeds: np.ndarray, positions: np.ndarray,
                   past_lens: np.ndarray, begins: np.ndarray, tables: list[np.ndarray]
                   ) -> np.ndarray:
        """One row of each sequence in ``laned``, in one inference on the lane; their
        logits [len(laned), V] in that order. The lane is refilled from the blocks unless
        it holds exactly these sequences as their blocks are now."""
        lane = self._lane
        assert lane is not None
        pasts = [int(past_lens[i]) for i in laned]
        seq_tables = [tables[i] for i in laned]
        order = lane.order_of(seq_tables, pasts, self._versions)
        if order is None:
            self._fill_lane(lane, seq_tables, pasts)
            order = list(range(len(laned)))
        hidden = embeds.shape[1]
        batch_embeds = np.empty((len(laned), 1, hidden), np.float32)
        batch_positions = np.empty((positions.shape[0], len(laned), 1), np.int64)
        for i, row in zip(laned, order, strict=True):
            batch_embeds[row, 0] = embeds[begins[i]]
            batch_positions[:, row, 0] = positions[:, begins[i]]
        logits = lane.slot.step_batch(batch_embeds, batch_positions)
        new_rows = lane.slot.new_rows()  # [members, heads, 1, head dim] each
        for blocks, past, row in zip(seq_tables, pasts, order, strict=True):
            self.write_rows(blocks, past, [cache[row:row + 1] for cache in new_rows])
        for blocks, past, row in zip(seq_tables, pasts, order, strict=True):
            lane.members[row].record(blocks, past + 1, self._versions)
        return logits[order]

    def _fill_lane(self, lane: _Lane, tables: list[np.ndarray], pasts: list[int]) -> None:
        """Load the lane with these sequences' rows from their blocks."""

        def fill(row: int, rows: list[np.ndarray]) -> None:
            for block, lo, n, at in self._spans(tables[row], 0, pasts[row]):
                for cache, out in zip(self._caches, rows, strict=True):
                    out[:, at:at + n] = cache[block, :, lo:lo + n]

        lane.slot.load_batch(pasts, fill)
        lane.members = []
        for blocks, past in zip(tables, pasts, strict=True):
            member = _Held()
            member.record(blocks, past, self._versions)
            lane.members.append(member)
        self.lane_loads += 1
        # A slot that prefilled one of these holds a copy the lane now has: drop it
        # (an f32 cache of a 2 000-row clip is 0.5 GB).
        for mirror in self._mirrors:
            if mirror.length and any(mirror.valid_rows(blocks, past, self._versions) > 0
                                     for blocks, past in zip(tables, pasts, strict=True)):
                mirror.slot.reset()
                mirror.forget()
