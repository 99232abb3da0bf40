"""The step scheduler: who runs in the next step, with how many rows, and on which blocks.

A policy over data, owned by the step loop (``batch.StepLoop``): every method runs on
the step thread (other threads reach it through the loop's inbox), so it has no lock,
starts no thread, reads no model and takes its clock as an argument; its unit tests
(``tests/engine/test_scheduler_policy.py``) drive it with fake sequences, fake step
outputs and a fake clock.

It owns every waiting state of a generation: arrived (its images to encode), encoding
(on one of ``encode_slots`` slot workers: the encoder budget), waiting for a place
(per user), and running (at most ``engine.max_sequences``); the KV blocks they get (the
block pool's only writer while the daemon runs) and the rows each step feeds (at most
``engine.max_batch_tokens``). Nothing waits on a thread for a place, a slot or a block:
what does not fit stays queued and is tried again at the next turn.

**KV blocks are taken as sequences grow**, not reserved for the worst case: admission
takes the blocks of the rows to feed (the prompt, or after a preemption the rows to
compute again) plus the next token's, leaving one spare block per running sequence;
each step then gives every sequence the blocks of the rows it feeds. A request whose
prompt and ``max_tokens`` could never fit the whole cache is refused up front (the
loop's ``submit``, naming ``engine.kv_cache_mb``).

Policy between users (uids; with API keys, one per key), one rule everywhere: **the
user holding the most gives way first.**

- **Encoding**: when a slot is free, the arrived generation of the user holding the
  fewest generations in the loop (encoding, waiting or running) is started (ties: the
  one whose encode started longest ago), each user's in arrival order. One user's burst
  of large pictures takes the free slots only while nobody else has one to encode.
- **Admission** takes the waiting user holding the fewest running sequences first
  (ties: the one that got a place longest ago, so equals take turns), and each user's
  sequences in arrival order (a preempted one first again). Admission stops at the
  first sequence that does not fit: nothing overtakes it, so a large request is not
  starved by a stream of small ones.
- **Preemption for a place**: when a waiting user cannot be admitted (the running set
  is full or its blocks do not fit), the user holding the most running sequences gives
  one up (its latest admitted) if it then still holds at least as many as the waiting
  user: shares level out, a lone user keeps everything, and two users never trade one
  place back and forth.
- **Preemption for a block**: when a running sequence needs a block and the pool has
  none free, the latest admitted sequence of the user holding the most (ties: the user
  admitted last) gives its blocks up, which may be the sequence itself.
- A preempted sequence keeps its shared prefix blocks, gives the rest back (full ones
  stay cached) and waits at the front of its user's queue; readmitted, it finds the
  blocks still cached and computes the rest again (its sampled token included), so its
  token ids are those it would have produced uninterrupted (vLLM's recompute).
- **Rows of a step**: every decoding sequence's next token, and the runs of tokens a
  response format forced (each whole, up to ``engine.prefill_chunk``), then prompt
  chunks of prefilling ones (at most ``engine.prefill_chunk`` each), the user who
  least recently got such rows first (then in admission order): one user's long
  prompts do not hold another's short one back for several steps.
- **Compute is shared too**: while users decode, the rows other users' prompts add to
  a step are bounded so that together they take one user's share of its time: with
  ``U`` users decoding, a step costs about ``1 + 1/U`` decoding steps (``StepCost``
  learns what a decoding step and a row cost from the steps the loop ran). One user's
  stream of long prompts then slows another's answer about 2x, not by a whole prompt
  chunk in every step (it was 11.5x: #46); the prompts still go in, in more steps. A
  lone user's own prompts and answers are not bounded against each other.

Sequences whose client left or whose deadline passed leave at the next step, running
or waiting.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from qvld.engine.loop.blocks import BlockPool
from qvld.engine.loop.sequence import Arrival, Sequence

T = TypeVar("T")

# At least this many rows of other users' prompts go in a step beside decoding
# sequences, however costly a row is (a prompt is never starved).
MIN_SHARED_ROWS = 16


class StepCost:
    """What a step costs, as medians of the latest steps the loop ran: a decoding step's
    seconds (steps that fed decoding tokens only) and a row's beyond that (steps that fed
    at least ``ROWS_TO_MEASURE`` other rows). Medians, not averages: on a shared box a
    step now and then waits for the CPU (another process, a page fault), and one such
    step must not make a decoding step look ten times dearer or a row free."""

    WINDOW = 15  # latest steps of each kind the medians are taken over
    ROWS_TO_MEASURE = 64

    def __init__(self) -> None:
        self.decode_s: float | None = None
        self.row_s: float | None = None
        self._decode_steps: collections.deque[float] = collections.deque(maxlen=self.WINDOW)
        self._row_costs: collections.deque[float] = collections.deque(maxlen=self.WINDOW)

    def observe(self, decoding: int, others: int, seconds: float) -> None:
        """A step fed ``decoding`` decoding tokens and ``others`` other rows."""
        if not others and decoding:
            self._decode_steps.append(seconds)
            self.decode_s = statistics.median(self._decode_steps)
        elif others >= self.ROWS_TO_MEASURE and self.decode_s is not None:
            self._row_costs.append(max(seconds - self.decode_s, 0.0) / others)
            self.row_s = statistics.median(self._row_costs)

    def rows_within(self, factor: float) -> int | None:
        """Rows a decoding step may take on and cost at most ``factor`` of one (at
        least MIN_SHARED_ROWS); None until both costs were seen."""
        if self.decode_s is None or not self.row_s:
            return None
        return max(MIN_SHARED_ROWS, int((factor - 1.0) * self.decode_s / self.row_s))


@dataclass
class Plan:
    """One step: ``rows`` (sequence, rows to feed) and the sequences that left."""

    rows: list[tuple[Sequence, int]] = field(default_factory=list)
    stopped: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # newly, this step
    preempted: list[Sequence] = field(default_factory=list)  # this step


class StepScheduler:
    def __init__(self, pool: BlockPool, *, max_sequences: int, max_batch_tokens: int,
                 chunk: int, encode_slots: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.encode_slots = encode_slots  # encodes at once (the slot workers)
        self._arrived: dict[int, collections.deque[Arrival]] = {}  # per uid, in order
        self._encoding: list[Arrival] = []
        self._encodes = 0
        self._last_encoded: dict[int, int] = {}  # uid -> when its last encode started
        self.max_sequences = max_sequences
        self.max_batch_tokens = max_batch_tokens
        self.chunk = chunk
        self.clock = clock
        self._waiting: dict[int, collections.deque[Sequence]] = {}  # per uid, in order
        self._running: list[Sequence] = []  # in admission order
        self.preemptions = 0
        self.peak_sequences = 0
        self._admissions = 0
        self._last_admitted: dict[int, int] = {}  # uid -> when it last got a place
        self.cost = StepCost()  # told by the loop after each step (``observe``)
        self._plans = 0
        self._rows_given: dict[int, int] = {}  # uid -> the last plan giving it such rows

    # -- arrivals: images to encode --------------------------------------------------

    def arrive(self, arrival: Arrival) -> None:
        self._arrived.setdefault(arrival.uid, collections.deque()).append(arrival)

    def remove_arrival(self, arrival: Arrival) -> bool:
        """Take ``arrival`` out before its encode started; False if it had."""
        return _unqueue(self._arrived, arrival.uid, arrival)

    def encoded(self, arrival: Arrival) -> None:
        """``arrival``'s encode is over (its sequence, if any, is ``add``ed)."""
        if arrival in self._encoding:
            self._encoding.remove(arrival)

    def encodes(self) -> tuple[list[Arrival], list[Arrival]]:
        """(arrivals to encode now, arrivals that stopped before): the free slots go to
        the users holding the fewest generations in the loop."""
        stopped = [a for queue in self._arrived.values() for a in queue if a.should_stop()]
        for arrival in stopped:
            self.remove_arrival(arrival)
        started: list[Arrival] = []
        while self._arrived and len(self._encoding) < self.encode_slots:
            held = collections.Counter(
                [s.uid for s in (*self._running, *self._iter_waiting())]
                + [a.uid for a in self._encoding])
            uid = min(self._arrived,
                      key=lambda u: (held[u], self._last_encoded.get(u, -1)))
            arrival = self._arrived[uid][0]
            self.remove_arrival(arrival)
            self._encodes += 1
            self._last_encoded[uid] = self._encodes
            self._encoding.append(arrival)
            started.append(arrival)
        return started, stopped

    def take_arrivals(self) -> list[Arrival]:
        """Every arrival not yet encoding, out (the engine is closing)."""
        arrivals = [a for queue in self._arrived.values() for a in queue]
        self._arrived.clear()
        return arrivals

    def arrivals(self) -> tuple[int, int]:
        """(arrived, encoding)."""
        return sum(len(q) for q in self._arrived.values()), len(self._encoding)

    # -- sequences ----------------------------------------------------------------------

    def fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` could ever run: its prompt and max_tokens within the whole
        cache (nothing else holding a block)."""
        return self.pool.fits(seq.max_rows)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (its ``fits`` checked by the caller)."""
        self._waiting.setdefault(seq.uid, collections.deque()).append(seq)

    def remove_waiting(self, seq: Sequence) -> bool:
        """Take a waiting ``seq`` out, its blocks back; False if it is not waiting."""
        if not self._unqueue(seq):
            return False
        self.pool.release(seq.lease)
        return True

    def finish(self, seq: Sequence) -> None:
        """``seq`` ended: out of the running set, its blocks back to the pool."""
        if seq in self._running:
            self._running.remove(seq)
        self.pool.release(seq.lease)

    def advance(self, seq: Sequence, rows: int) -> None:
        """A step fed ``rows`` rows of ``seq``: its fed token (if any) becomes a row of
        its cache, and the blocks those rows filled are published for reuse."""
        if seq.token is not None:
            seq.keys.append((seq.token, None))
            seq.token = None
        seq.fed += rows
        self.pool.publish(seq.lease, seq.keys, seq.owner, seq.fed)

    def observe(self, decoding: int, others: int, seconds: float) -> None:
        """A step fed ``decoding`` decoding tokens and ``others`` other rows in
        ``seconds`` (the loop's measure, planning and sampling included)."""
        self.cost.observe(decoding, others, seconds)

    def snapshot(self) -> tuple[list[Sequence], list[Sequence]]:
        """(running, waiting)."""
        return list(self._running), list(self._iter_waiting())

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self._running), sum(len(queue) for queue in self._waiting.values())

    @property
    def idle(self) -> bool:
        """Nothing to step or to start (encodes under way post back when done)."""
        return not self._running and not self._waiting and not self._arrived

    def take_all(self) -> list[Sequence]:
        """Every sequence out of the scheduler, its blocks back (a runtime failure ends
        them all)."""
        seqs = [*self._running, *self._iter_waiting()]
        self._running.clear()
        self._waiting.clear()
        for seq in seqs:
            self.pool.release(seq.lease)
        return seqs

    # -- one step -------------------------------------------------------------------

    def schedule(self) -> Plan:
        """The next step: who left, who is admitted (or preempted), and the rows."""
        plan = Plan()
        # One running on another thread (``outside``) is stopped once it is back: its
        # blocks may still be written and its decoding is still choosing.
        for seq in [s for s in self._running if not s.outside and s.decoding.should_stop()]:
            self.finish(seq)
            plan.stopped.append(seq)
        for seq in [s for s in self._iter_waiting() if s.decoding.should_stop()]:
            self.remove_waiting(seq)
            plan.stopped.append(seq)
        self._admit(plan)
        self.peak_sequences = max(self.peak_sequences, len(self._running))
        budget = self.max_batch_tokens
        # Decoding sequences' next tokens first, in admission order; then generated rows
        # (a forced run; rows computed again after the prompt) before prompt rows: a
        # decoding sequence is not held back by others' prompts.
        runnable = [s for s in self._running if not s.outside]
        order = ([s for s in runnable if s.token is not None]
                 + sorted((s for s in runnable if s.token is None),
                          key=lambda s: (s.in_prompt, self._rows_given.get(s.uid, -1))))
        decoding = {s.uid for s in runnable if s.token is not None}
        # Rows beside other users' decoding sequences, shared by all who add them.
        shared = self.cost.rows_within(1.0 + 1.0 / len(decoding)) if decoding else None
        for seq in order:
            if budget <= 0 or seq not in self._running:  # preempted for a block meanwhile
                continue
            n = 1 if seq.token is not None else min(budget, self.chunk,
                                                    len(seq.keys) - seq.fed)
            if seq.token is None and shared is not None and decoding - {seq.uid}:
                n = min(n, shared)
                shared -= n
            if n > 0 and self._room(seq, seq.fed + n, plan):
                plan.rows.append((seq, n))
                budget -= n
                if seq.token is None:
                    self._rows_given[seq.uid] = self._plans
        self._plans += 1
        return plan

    def _room(self, seq: Sequence, rows: int, plan: Plan) -> bool:
        """Blocks for ``seq``'s first ``rows`` rows, preempting the latest admitted
        sequence of the user holding the most while the pool has none; False when
        ``seq`` itself gave way."""
        while not self.pool.grow(seq.lease, seq.keys, seq.owner, rows, reuse=False):
            victim = self._victim()
            if victim is None:  # only prefills running elsewhere hold the rest
                victim = seq
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _victim(self) -> Sequence | None:
        """The latest admitted sequence of the user holding the most running ones (ties:
        the user admitted last), among those not prefilled elsewhere."""
        held = collections.Counter(s.uid for s in self._running if not s.outside)
        if not held:
            return None
        most = max(held, key=lambda u: (held[u], self._last_admitted.get(u, -1)))
        return [s for s in self._running if s.uid == most and not s.outside][-1]

    def _admit(self, plan: Plan) -> None:
        """Admit waiting sequences while they fit, preempting for fairness."""
        while self._waiting:
            held = collections.Counter(s.uid for s in self._running)
            # The fewest held first; among equals, who got a place longest ago.
            uid = min(self._waiting, key=lambda u: (held[u], self._last_admitted.get(u, -1)))
            seq = self._waiting[uid][0]
            full = len(self._running) >= self.max_sequences
            # Its rows to feed and its next token's, with a block to spare for each
            # running sequence's growth: admitting must not preempt at the next step.
            rows = min(len(seq.keys) + 1, seq.max_rows)
            if full or not self.pool.grow(seq.lease, seq.keys, seq.owner, rows,
                                          spare=len(self._running)):
                if not self._preempt_for(uid, held, plan):
                    return
                continue
            self._unqueue(seq)
            self._admissions += 1
            self._last_admitted[uid] = self._admissions
            seq.fed = max(seq.fed, seq.lease.shared)
            if seq.admitted is None:
                seq.admitted = self.clock()
                seq.cached = seq.fed
            self._running.append(seq)
            plan.admitted.append(seq)

    def _preempt_for(self, uid: int, held: collections.Counter[int], plan: Plan) -> bool:
        """Preempt one sequence of the user holding the most, if it then still holds at
        least as many as ``uid`` does with the freed place."""
        most = max(held, key=lambda u: held[u], default=None)
        if most is None or most == uid or held[most] <= held[uid] + 1:
            return False
        victims = [s for s in self._running if s.uid == most and not s.outside]
        if not victims:  # all of its sequences are being prefilled elsewhere
            return False
        self._preempt(victims[-1], plan)
        return True

    def _preempt(self, victim: Sequence, plan: Plan) -> None:
        """``victim`` back to the front of its user's queue, keeping its shared prefix."""
        self._running.remove(victim)
        plan.rows = [(s, n) for s, n in plan.rows if s is not victim]
        self.pool.shrink(victim.lease, victim.cached)
        victim.preempted()
        self._waiting.setdefault(victim.uid, collections.deque()).appendleft(victim)
        self.preemptions += 1
        plan.preempted.append(victim)

    # -- the waiting queues -----------------------------------------------------------

    def _iter_waiting(self) -> Iterable[Sequence]:
        return (seq for queue in self._waiting.values() for seq in queue)

    def _unqueue(self, seq: Sequence) -> bool:
        return _unqueue(self._waiting, seq.uid, seq)


def _unqueue(queues: dict[int, collections.deque[T]], uid: int, item: T) -> bool:
    """``item`` out of ``uid``'s queue (the queue gone once empty); False if not there."""
    queue = queues.get(uid)
    if queue is None or item not in queue:
        return False
    queue.remove(item)
    if not queue:
        del queues[uid]
    return True
