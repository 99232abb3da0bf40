"""Continuous batching: the step loop, one thread that owns every admitted or waiting
generation and advances the running ones together.

Other threads talk to it only through its inbox (``submit``, ``cancel``, ``joined``),
which it drains at the top of each iteration; then it asks the scheduler
(``scheduler.StepScheduler``, a policy it owns) who runs and with how many rows: the
next token of every decoding sequence, then prompt chunks of those still prefilling.
One inference over the packed rows (paged attention: each sequence reads its own
blocks) returns the last row's logits per sequence; each is sampled with its own
parameters, stop rules and stream (``decoding.generation.Decoding``). Cancel, deadlines and client
disconnects end a sequence at the next step and give its blocks back; an error in one
sequence's sampling ends that one only. Imports no runtime: the model is a
``model.interface.PagedModel``.

Generations are data. One arrives (``arrive``: a ``sequence.Arrival``) before its
images are encoded: the scheduler starts its encode on one of the ``encoders`` slot
worker threads (``qvld-slot-N``) when a slot is free and its user's turn has come;
the encode embeds the prompt rows and hands the ``sequence.Sequence`` over with
``submit``, whose end is told through its ``on_done``, always called on the step
thread; no thread waits per sequence. A prompt prefilled by another runtime
(``model.prompt_backend``) is handed to ``prompt_prefill.PromptPrefills`` once admitted
(the sequence is then ``outside``: the loop does not touch it) and comes back through
``joined``.
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from qvld.engine.loop.blocks import BlockPool
from qvld.engine.loop.lane import Lane
from qvld.engine.loop.prompt_prefill import PromptPrefills
from qvld.engine.loop.scheduler import StepScheduler
from qvld.engine.loop.sequence import Arrival, Sequence
from qvld.engine.model.interface import PagedModel, RowsSlot
from qvld.errors import BadRequest, InternalError, Unavailable

log = logging.getLogger("qvld.engine")

# A token choice whose matcher work took more CPU time than this on the step thread (or
# half a decoding step, if more) makes its sequence's later choices go beside the steps.
SLOW_CHOICE_S = 0.001
# Their lane yields the cores to the steps: a matcher's work is what the cores have
# left over while others decode (2 cores: a lane at the same priority halved a step's
# threads and slowed another user's answer 7.9x).
MATCHER_NICE = 10


class StepLoop:
    """The step loop over one paged model and its block pool.

    One thread (``qvld-step``) owns the scheduler, the block pool's leases and every
    admitted or waiting sequence. Other threads only post to its inbox (``submit``,
    ``cancel``, ``joined``), drained at the top of each iteration; ``on_done`` is always
    called on that thread. It sleeps on its inbox when nothing can step, never polls;
    a deadline reaches it as a ``cancel`` (the handlers' timer), a client that left
    likewise. Status reads ``view``: the running and waiting sequences as the loop
    last published them.
    """

    def __init__(self, model: PagedModel, pool: BlockPool, *, max_sequences: int,
                 max_batch_tokens: int, chunk: int,
                 on_step: Callable[[int, int], None] | None = None,
                 on_prefill: Callable[[str, int], None] | None = None,
                 runtime: str = "openvino", prompt_slot: RowsSlot | None = None,
                 prompt_runtime: str = "onnxruntime", encoders: int = 1) -> None:
        self.model = model
        self.runtime = runtime  # the paged model's, for status and metrics
        self.pool = pool
        self.scheduler = StepScheduler(pool, max_sequences=max_sequences,
                                       max_batch_tokens=max_batch_tokens, chunk=chunk,
                                       encode_slots=encoders)
        # Images encoded and prompts embedded, as many at once as there are slots: the
        # scheduler decides whose, and when.
        self.encoders = Lane("qvld-slot", threads=encoders)
        self._closed = False
        self.chunk = chunk  # rows of one prompt per step at most
        self.on_step = on_step  # (sequences, prefill rows) after every step
        # (runtime, prompt rows) whenever a runtime computed prompt rows: the step's, or
        # the prompt runtime's.
        self.on_prefill = on_prefill
        # Admitted sequences' prompts prefilled on another runtime (model.prompt_backend),
        # on a thread and a slot of their own; None: the steps prefill every prompt.
        self.prefills = None if prompt_slot is None else PromptPrefills(
            prompt_slot, model, chunk, prompt_runtime,
            lambda seq, fed, error: self.joined(seq, fed, prompt_runtime, error))
        self.outside_runtime = prompt_runtime if prompt_slot is not None else runtime
        # Token choices of sequences whose response format is slow to follow, beside the
        # steps: one answer's costly grammar does not hold everyone's step.
        self.matchers = Lane("qvld-matcher", nice=MATCHER_NICE)
        self._cond = threading.Condition()
        self._inbox: collections.deque[Callable[[], None]] = collections.deque()
        self._held = False  # steps held (``hold``): the inbox is still drained
        # (when, tie-break, message): messages the loop posts to itself for later.
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_ids = itertools.count()
        self.steps = 0
        # (running, waiting) as the loop last published them: read by other threads.
        self.view: tuple[tuple[Sequence, ...], tuple[Sequence, ...]] = ((), ())
        # Started by the first sequence, gone when none is left: an engine replaced by a
        # reload leaves no thread (and no model) behind.
        self._thread: threading.Thread | None = None

    @property
    def max_batch_tokens(self) -> int:
        return self.scheduler.max_batch_tokens

    @property
    def max_sequences(self) -> int:
        return self.scheduler.max_sequences

    @property
    def peak_sequences(self) -> int:
        return self.scheduler.peak_sequences

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    # -- from any thread: the inbox -----------------------------------------------------

    def arrive(self, arrival: Arrival) -> None:
        """Queue a generation whose images are still to encode (Unavailable once
        ``close`` was called)."""
        with self._cond:
            if self._closed:
                raise Unavailable("the daemon is shutting down")
        self._post(lambda: self.scheduler.arrive(arrival))

    def cancel_arrival(self, arrival: Arrival) -> None:
        """End ``arrival`` if its encode has not started (it then ``drop``s); one
        encoding sees its ``should_stop``."""
        def drop() -> None:
            if self.scheduler.remove_arrival(arrival):
                arrival.drop()

        self._post(drop)

    def close(self) -> None:
        """Take no more arrivals; those not yet encoding are dropped."""
        with self._cond:
            self._closed = True
        def drop_all() -> None:
            for arrival in self.scheduler.take_arrivals():
                arrival.drop()

        self._post(drop_all)

    def submit(self, seq: Sequence) -> None:
        """Hand ``seq`` over; its ``on_done`` tells the end. BadRequest when it could
        never fit the KV cache (checked here, before it is queued)."""
        if not self.scheduler.fits(seq):
            raise BadRequest(
                f"this request needs {seq.max_rows} rows of KV cache (its prompt, session "
                f"history and max_tokens), more than engine.kv_cache_mb holds "
                f"({self.pool.num_blocks * self.pool.block_size}); ask for fewer tokens or "
                "start a new session")
        self._post(lambda: self._add(seq))

    def cancel(self, seq: Sequence) -> None:
        """End ``seq``: a waiting one at once (the loop's next turn, even while steps are
        held), a running one at the next step (its ``should_stop`` tells it)."""
        self._post(lambda: self._cancel(seq))

    def joined(self, seq: Sequence, fed: bool, runtime: str,
               error: BaseException | None = None) -> None:
        """A prefill on another runtime is over (``fed``: it went to the end)."""
        self._post(lambda: self._joined(seq, fed, runtime, error))

    def hold(self) -> None:
        """Run no step until ``release``: requests are still taken in, cancels and
        prefills done elsewhere handled, and ``view`` kept current (tests set up who
        waits behind whom this way, however loaded the machine)."""
        with self._cond:
            self._held = True

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify()

    def _post(self, message: Callable[[], None]) -> None:
        with self._cond:
            self._inbox.append(message)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="qvld-step",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    @property
    def busy_since(self) -> float | None:
        return self.model.busy_since

    def sequences(self) -> list[dict[str, Any]]:
        """Each generation admitted or waiting for a place: rows fed, tokens so far,
        state and the runtime computing it, for status."""
        running, waiting = self.view
        states = ["prefill" if s.in_prompt or self._prefilled_outside(s) else "decode"
                  for s in running]
        states += ["waiting"] * len(waiting)
        return [{"uid": s.uid, "prompt_tokens": len(s.prompt.ids), "cached_tokens": s.cached,
                 "fed_tokens": s.fed, "generated_tokens": s.generated, "state": state,
                 "preemptions": s.preemptions,
                 "runtime": (self.outside_runtime if self._prefilled_outside(s)
                             else self.runtime)}
                for s, state in zip([*running, *waiting], states, strict=True)]

    def counts(self) -> tuple[int, int]:
        """(decoding, prefilling) sequences admitted, those prefilled by another runtime
        included."""
        running, _ = self.view
        prefilling = sum(1 for s in running if s.in_prompt or self._prefilled_outside(s))
        return len(running) - prefilling, prefilling

    @staticmethod
    def _prefilled_outside(seq: Sequence) -> bool:
        return seq.outside and not seq.slow_choice

    def queued(self) -> tuple[int, int]:
        """(running, waiting) sequences, as last published."""
        running, waiting = self.view
        return len(running), len(waiting)

    # -- the step thread: the inbox's messages --------------------------------------------

    def _add(self, seq: Sequence) -> None:
        if seq.decoding.finish is None and not seq.decoding.should_stop():
            self.scheduler.add(seq)
            return
        if seq.decoding.finish is None:  # cancelled before it reached the loop
            seq.decoding.cancel()
        self.pool.release(seq.lease)
        self._end(seq)

    def _cancel(self, seq: Sequence) -> None:
        if self.scheduler.remove_waiting(seq):
            seq.decoding.cancel()
            self._end(seq)

    def _joined(self, seq: Sequence, fed: bool, runtime: str,
                error: BaseException | None) -> None:
        if seq.ended:  # a runtime failure ended every sequence meanwhile
            return
        if self.on_prefill is not None and seq.fed > seq.cached:
            self.on_prefill(runtime, seq.fed - seq.cached)
        if fed and error is None:
            self.pool.publish(seq.lease, seq.keys, seq.owner, seq.fed)
            seq.prefilled()
        seq.outside = False
        if error is not None or not fed or seq.decoding.finish is not None:
            self.scheduler.finish(seq)
            if not fed and error is None:
                seq.decoding.cancel()
            self._end(seq, error)
        elif seq.logits is not None:
            self._await_format(seq)

    def _await_format(self, seq: Sequence) -> None:
        """``seq``'s prompt is in and its logits kept, its response format still
        compiling: it holds its place, feeds nothing, and its first token is chosen when
        the compile ends or its time is up, whichever comes first (no thread waits)."""
        constraint = seq.decoding.constraint
        assert constraint is not None
        # Whichever fires first takes the sequence; the other (the timer may wait for
        # the whole compile timeout) then holds nothing.
        waiting = [seq]

        def ready() -> None:
            if waiting:
                self._format_ready(waiting.pop())

        constraint.future.add_done_callback(lambda _: self._post(ready))
        self._after(constraint.remaining_s, ready)

    def _format_ready(self, seq: Sequence) -> None:
        logits, seq.logits = seq.logits, None
        if logits is not None and seq.decoding.finish is None:  # not ended or preempted
            self._choose(seq, logits)

    def _after(self, delay: float, message: Callable[[], None]) -> None:
        """Run ``message`` on the step thread ``delay`` seconds from now (a timer the
        loop's sleep wakes for)."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._timer_ids),
                                      message))

    # -- the step thread ----------------------------------------------------------------

    def _loop(self) -> None:
        stalled = False  # the last step fed nothing: only a message can change that
        while True:
            with self._cond:
                while not self._inbox and (self._held or stalled) and not self._due():
                    if self.scheduler.idle and not self._held:
                        break
                    self._cond.wait(self._timers[0][0] - time.monotonic()
                                    if self._timers else None)
                messages = list(self._inbox)
                self._inbox.clear()
                while self._due():
                    messages.append(heapq.heappop(self._timers)[2])
                if not messages and self.scheduler.idle:
                    self.view = ((), ())
                    self._timers.clear()  # only ever for sequences that ended
                    self._thread = None
                    return
                held = self._held
            for message in messages:
                try:
                    message()
                except Exception:  # a message reports its own errors; a bug's last stop
                    log.exception("step loop message failed")
            stalled = stalled and not messages
            self._start_encodes()
            if not held:
                try:
                    stalled = not self._step()
                except Exception as exc:  # a runtime failure: every sequence in it fails
                    log.exception("batched step failed")
                    for seq in self.scheduler.take_all():
                        self._end(seq, exc)
            self._publish()

    def _start_encodes(self) -> None:
        """The encodes the scheduler starts now, on the slot workers (also while steps
        are held: an encode is not a step); each posts ``encoded`` back when done."""
        started, stopped = self.scheduler.encodes()
        for arrival in stopped:
            arrival.drop()
        for arrival in started:
            self.encoders.submit(functools.partial(self._encode, arrival))

    def _encode(self, arrival: Arrival) -> None:
        try:
            arrival.encode()
        finally:
            self._post(lambda: self.scheduler.encoded(arrival))

    def _due(self) -> bool:
        return bool(self._timers) and self._timers[0][0] <= time.monotonic()

    def _publish(self) -> None:
        running, waiting = self.scheduler.snapshot()
        self.view = (tuple(running), tuple(waiting))

    def _step(self) -> bool:
        t_plan = time.perf_counter()
        plan = self.scheduler.schedule()
        for seq in plan.stopped:
            seq.decoding.cancel()
            self._end(seq)
        for seq in plan.admitted:
            if (self.prefills is not None and seq.prefill_outside and not seq.preemptions
                    and seq not in plan.preempted):
                seq.outside = True
                self.prefills.submit(seq)
        rows = [(seq, n) for seq, n in plan.rows if not seq.outside]
        if not rows:  # a change may let the next step feed; else wait for a message
            return bool(plan.stopped or plan.admitted or plan.preempted)
        # Decoding sequences' single next tokens are embedded together; every other
        # sequence's rows (a prompt chunk, forced tokens, rows to compute again) its own.
        decoders = [seq for seq, n in rows if seq.token is not None]
        embeds, positions, masks, deepstacks = [], [], [], []
        if decoders:
            ids = np.array([seq.token for seq in decoders], dtype=np.int64)
            embeds.append(self.model.embed(ids))
            pos = np.array([seq.fed + seq.prompt.rope_delta for seq in decoders], np.int64)
            positions.append(np.broadcast_to(pos, (3, len(decoders))))
            masks.append(np.zeros(len(decoders), dtype=bool))
        prefill_rows = 0
        for seq, n in rows[len(decoders):]:
            e, p, m, d = seq.rows(n, self.model.embed)
            embeds.append(e)
            positions.append(p)
            masks.append(m)
            if d is not None:
                deepstacks.append(d)
            if seq.in_prompt:
                prefill_rows += min(n, len(seq.prompt.ids) - seq.fed)
        counts = np.array([n for _, n in rows], dtype=np.int32)
        past = np.array([seq.fed for seq, _ in rows], dtype=np.int32)
        tables = [seq.lease.blocks[:self.pool.blocks_for(seq.fed + n)] for seq, n in rows]
        logits = self.model.step(
            np.concatenate(embeds), np.concatenate(positions, axis=1), np.concatenate(masks),
            np.concatenate(deepstacks, axis=1) if deepstacks else self.model.no_deepstack(),
            past, np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
            np.concatenate(tables).astype(np.int32))
        self.steps += 1
        now = time.perf_counter()
        for i, (seq, n) in enumerate(rows):
            self.scheduler.advance(seq, n)
            if seq.prefilling:
                continue
            if not seq.t_prefill:
                seq.t_prefill = now
                seq.prefilled()
            if seq.awaits_format:
                seq.logits = np.array(logits[i])
                self._await_format(seq)
            else:
                self._choose(seq, np.array(logits[i]))
        # What the step cost a decoding sequence in it: the scheduler shares compute by it.
        self.scheduler.observe(len(decoders), int(counts.sum()) - len(decoders),
                               time.perf_counter() - t_plan)
        if self.on_step is not None:
            self._publish()  # what the hook reads (a test's step gate) is this step's
            self.on_step(len(rows), prefill_rows)
        if self.on_prefill is not None and prefill_rows:
            self.on_prefill(self.runtime, prefill_rows)
        return True

    def _choose(self, seq: Sequence, logits: np.ndarray) -> None:
        """``seq``'s next token(s) from ``logits``; ended when a stop rule fired. A
        sequence whose response format was slow to follow chooses on the matcher lane,
        out of the steps until it is back (``_chosen``); one becomes slow when a choice
        here took more than ``SLOW_CHOICE_S`` or half a decoding step."""
        if seq.slow_choice:
            self._choose_aside(seq, logits)
            return
        t0 = time.thread_time()
        try:
            tokens = seq.decoding.accept(logits)
        except Exception as exc:
            self._took(seq, None, exc)
            return
        if seq.decoding.constraint is not None and time.thread_time() - t0 > max(
                SLOW_CHOICE_S, 0.5 * (self.scheduler.cost.decode_s or 0.0)):
            seq.slow_choice = True
        self._took(seq, tokens, None)

    def _choose_aside(self, seq: Sequence, logits: np.ndarray) -> None:
        seq.outside = True

        def choose() -> None:
            tokens, error = None, None
            try:
                tokens = seq.decoding.accept(logits)
            except Exception as exc:  # posted back: the step thread ends the sequence
                error = exc
            self._post(lambda: self._chosen(seq, tokens, error))

        self.matchers.submit(choose)

    def _chosen(self, seq: Sequence, tokens: list[int] | None,
                error: BaseException | None) -> None:
        seq.outside = False
        if not seq.ended:  # a runtime failure may have ended every sequence meanwhile
            self._took(seq, tokens, error)

    def _took(self, seq: Sequence, tokens: list[int] | None,
              error: BaseException | None) -> None:
        """What ``seq``'s decoding chose (or raised): fed next, or its end."""
        try:
            if error is not None:
                raise error
            seq.take(tokens)
            if seq.decoding.finish is None and seq.token is None and not seq.prefilling:
                # Nothing to feed and not ended: it would hold its place and blocks,
                # never stepped again, until its deadline. A bug; end it loudly.
                raise InternalError("the generation chose no token and did not end "
                                    f"(after {seq.generated} tokens)")
        except Exception as exc:  # this sequence's sampling or streaming only
            if isinstance(exc, InternalError):
                log.error("sequence of uid %d ended: %s", seq.uid, exc)
            self.scheduler.finish(seq)
            self._end(seq, exc)
            return
        if seq.decoding.finish is not None:
            self.scheduler.finish(seq)
            self._end(seq)

    def _end(self, seq: Sequence, error: BaseException | None = None) -> None:
        """Tell ``seq``'s owner it ended (its blocks are back already)."""
        if error is None:
            seq.outcome = seq.decoding.outcome(seq.t0, seq.t_prefill or time.perf_counter(),
                                               seq.cached)
        seq.error = error
        if seq.decoding.constraint is not None:  # a compile nobody waits for may stop
            seq.decoding.constraint.abandon()
        seq.ended = True
        if seq.on_done is not None:
            seq.on_done(seq)
