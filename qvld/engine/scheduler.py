"""The step scheduler: who runs in the next step, with how many rows, and on which blocks.

Owns, under one lock, everything admission decides: the waiting sequences (per user),
the running set (at most ``engine.max_sequences``), the KV blocks they get (the block
pool's only reader while the daemon runs) and the rows each step feeds (at most
``engine.max_batch_tokens``). The step loop (``batch.BatchRunner``) calls ``schedule``
once per step; nothing waits on a thread for a slot or a block: a sequence that does
not fit stays waiting and is tried again at the next step.

Policy between users (uids; with API keys, one per key):

- **Admission** takes the waiting user holding the fewest running sequences first
  (ties: the one that got a place longest ago, so equals take turns), and each user's
  sequences in arrival order (a preempted one first again). Admission stops at the
  first sequence that does not fit: nothing overtakes it, so a large request is not
  starved by a stream of small ones.
- **Preemption** keeps it fair at every step, not only at admission: when a waiting
  user cannot be admitted (the running set is full or its blocks do not fit), the
  user holding the most running sequences gives one up (its latest admitted) if it
  then still holds at least as many as the waiting user: shares level out, a lone
  user keeps everything, and two users never trade one slot back and forth.
  The preempted sequence keeps its shared prefix blocks, gives the rest back (full
  ones stay cached) and waits at the front of its user's queue; readmitted, it finds
  the blocks still cached and computes the rest again (its sampled token included),
  so its token ids are those it would have produced uninterrupted (vLLM's recompute).
- **Rows of a step**: every decoding sequence's next token, and the runs of tokens a
  response format forced (each whole, up to ``engine.prefill_chunk``), then prompt
  chunks of prefilling ones in admission order (at most ``engine.prefill_chunk``
  each).

Sequences whose client left or whose deadline passed leave at the next step, running
or waiting.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from qvld.engine.blocks import BlockPool
from qvld.engine.sequence import Sequence
from qvld.errors import BadRequest


@dataclass
class Plan:
    """One step: ``rows`` (sequence, rows to feed) and the sequences that left."""

    rows: list[tuple[Sequence, int]] = field(default_factory=list)
    stopped: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # newly, this step


class StepScheduler:
    def __init__(self, pool: BlockPool, *, max_sequences: int, max_batch_tokens: int,
                 chunk: int) -> None:
        self.pool = pool
        self.max_sequences = max_sequences
        self.max_batch_tokens = max_batch_tokens
        self.chunk = chunk
        self._lock = threading.Lock()
        self._waiting: dict[int, collections.deque[Sequence]] = {}  # per uid, in order
        self._running: list[Sequence] = []  # in admission order
        self.preemptions = 0
        self.peak_sequences = 0
        self._admissions = 0
        self._last_admitted: dict[int, int] = {}  # uid -> when it last got a place

    # -- from any thread ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; BadRequest when it could never fit the KV cache. (How many may
        wait is the engine's to bound, before their images are encoded.)"""
        if not self.pool.fits(seq.max_rows):
            raise BadRequest(
                f"this request needs {seq.max_rows} rows of KV cache (its prompt, session "
                f"history and max_tokens), more than engine.kv_cache_mb holds "
                f"({self.pool.num_blocks * self.pool.block_size}); ask for fewer tokens or "
                "start a new session")
        with self._lock:
            self._waiting.setdefault(seq.uid, collections.deque()).append(seq)

    def remove_waiting(self, seq: Sequence) -> bool:
        """Take a waiting ``seq`` out (its client left); False if it is not waiting."""
        with self._lock:
            queue = self._waiting.get(seq.uid)
            if queue is None or seq not in queue:
                return False
            queue.remove(seq)
            if not queue:
                del self._waiting[seq.uid]
            return True

    def finish(self, seq: Sequence) -> None:
        """``seq`` ended: out of the running set, its blocks back to the pool."""
        with self._lock:
            if seq in self._running:
                self._running.remove(seq)
        self.pool.release(seq.lease)

    def snapshot(self) -> tuple[list[Sequence], list[Sequence]]:
        """(running, waiting), as one moment saw them."""
        with self._lock:
            return list(self._running), list(self._iter_waiting())

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        with self._lock:
            return len(self._running), self._waiting_count()

    @property
    def idle(self) -> bool:
        with self._lock:
            return not self._running and not self._waiting

    def take_all(self) -> list[Sequence]:
        """Every sequence, out of the scheduler (a runtime failure ends them all)."""
        with self._lock:
            seqs = [*self._running, *self._iter_waiting()]
            self._running.clear()
            self._waiting.clear()
        return seqs

    # -- the step thread ----------------------------------------------------------------

    def schedule(self) -> Plan:
        """The next step: who left, who is admitted (or preempted), and the rows."""
        plan = Plan()
        with self._lock:
            for seq in [s for s in self._running if s.decoding.should_stop()]:
                self._running.remove(seq)
                plan.stopped.append(seq)
            for seq in [s for s in self._iter_waiting() if s.decoding.should_stop()]:
                self._unqueue(seq)
                plan.stopped.append(seq)
            self._admit(plan)
            self.peak_sequences = max(self.peak_sequences, len(self._running))
            runnable = [s for s in self._running if not s.outside]
            plan.rows = [(s, 1) for s in runnable if s.token is not None]
            budget = self.max_batch_tokens - len(plan.rows)
            # Generated rows (a forced run; rows computed again after the prompt) before
            # prompt rows: a decoding sequence is not held back by others' prompts.
            for seq in sorted((s for s in runnable if s.token is None),
                              key=lambda s: s.in_prompt):
                if budget <= 0:
                    break
                n = min(budget, self.chunk, len(seq.keys) - seq.fed)
                if n > 0:
                    plan.rows.append((seq, n))
                    budget -= n
        for seq in plan.stopped:
            self.pool.release(seq.lease)
        return plan

    def _admit(self, plan: Plan) -> None:
        """Admit waiting sequences while they fit, preempting for fairness (lock held)."""
        while self._waiting:
            held = collections.Counter(s.uid for s in self._running)
            # The fewest held first; among equals, who got a place longest ago.
            uid = min(self._waiting, key=lambda u: (held[u], self._last_admitted.get(u, -1)))
            seq = self._waiting[uid][0]
            full = len(self._running) >= self.max_sequences
            if full or not self.pool.grow(seq.lease, seq.keys, seq.owner, seq.max_rows):
                if not self._preempt_for(uid, held):
                    return
                continue
            self._unqueue(seq)
            self._admissions += 1
            self._last_admitted[uid] = self._admissions
            seq.fed = max(seq.fed, seq.lease.shared)
            if seq.admitted is None:
                seq.admitted = time.monotonic()
                seq.cached = seq.fed
            self._running.append(seq)
            plan.admitted.append(seq)

    def _preempt_for(self, uid: int, held: collections.Counter[int]) -> bool:
        """Preempt one sequence of the user holding the most, if it then still holds at
        least as many as ``uid`` does with the freed place (lock held)."""
        most = max(held, key=lambda u: held[u], default=None)
        if most is None or most == uid or held[most] <= held[uid] + 1:
            return False
        victims = [s for s in self._running if s.uid == most and not s.outside]
        if not victims:  # all of its sequences are being prefilled elsewhere
            return False
        victim = victims[-1]
        self._running.remove(victim)
        self.pool.shrink(victim.lease, victim.cached)
        victim.preempted()
        self._waiting.setdefault(most, collections.deque()).appendleft(victim)
        self.preemptions += 1
        return True

    # -- the waiting queues (lock held) -----------------------------------------------

    def _iter_waiting(self) -> Iterable[Sequence]:
        return (seq for queue in self._waiting.values() for seq in queue)

    def _waiting_count(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    def _unqueue(self, seq: Sequence) -> None:
        queue = self._waiting.get(seq.uid)
        if queue is not None and seq in queue:
            queue.remove(seq)
            if not queue:
                del self._waiting[seq.uid]
