"""Continuous batching: one step thread advances every running generation together.

Each step packs the next token of every decoding sequence, then prompt rows of the
sequences still prefilling (oldest first) up to ``max_batch_tokens``: running streams
never wait behind a long prompt for more than one step, and a long prompt is fed in
chunks between their tokens (chunked prefill). One inference over the packed rows
(paged attention: each sequence reads its own blocks) returns the last row's logits per
sequence; each is sampled with its own parameters, stop rules and stream
(``generate.Decoding``). Cancel, deadlines and client disconnects end a sequence at the
next step and give its blocks back; an error in one sequence's sampling ends that one
only. Imports no runtime: the model is a ``slots.PagedModel``.

The caller's thread (a scheduler worker) does everything before: blocks leased from the
``BlockPool`` (reusing a cached prefix), images encoded on its own slot (beside the
steps, not in front of them), the prompt's rows embedded. It then waits for the outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qvld.engine.blocks import BlockPool, Lease, RowKey
from qvld.engine.generate import Decoding, Outcome, Prompt
from qvld.engine.slots import PagedModel, RowsSlot

log = logging.getLogger("qvld.engine")


@dataclass(eq=False)
class BatchSequence:
    """One generation in the step loop."""

    prompt: Prompt
    embeds: np.ndarray  # [len(ids) - cached, H]: the prompt rows still to feed
    lease: Lease
    owner: int | None
    decoding: Decoding
    uid: int = 0  # who asked (status shows a user their own)
    fed: int = 0  # rows in the KV cache
    keys: list[RowKey] = field(default_factory=list)  # of every row fed or to feed
    token: int | None = None  # sampled, not yet fed
    t0: float = field(default_factory=time.perf_counter)
    t_prefill: float = 0.0
    outcome: Outcome | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.cached = self.fed = self.lease.shared
        self.keys = list(self.prompt.keys)
        self._vis_index = np.cumsum(self.prompt.visual_mask) - 1

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.prompt.ids)

    def rows(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The next ``n`` prompt rows: embeddings, positions, visual mask, deepstack."""
        lo, hi = self.fed, self.fed + n
        mask = self.prompt.visual_mask[lo:hi]
        deepstack = None
        if mask.any():
            deepstack = self.prompt.deepstack[:, self._vis_index[lo:hi][mask]]
        return (self.embeds[lo - self.cached:hi - self.cached],
                self.prompt.positions[:, lo:hi], mask, deepstack)


def prefill_elsewhere(slot: RowsSlot, model: PagedModel, seq: BatchSequence,
                      chunk: int) -> bool:
    """Feed ``seq``'s prompt rows on ``slot`` (another runtime: model.prompt_backend),
    starting from its shared prefix read out of the paged cache; take its first token
    from the last row's logits, then copy the new rows into its own blocks (after the
    token went out: the copy is not in the time to it). False when it should stop."""
    slot.load_rows(model.read_rows(seq.lease.blocks, seq.cached))
    try:
        logits = None
        while seq.prefilling:
            if seq.decoding.should_stop():
                return False
            embeds, positions, mask, deepstack = seq.rows(min(chunk, len(seq.prompt.ids)
                                                              - seq.fed))
            logits = slot.step(embeds, positions, mask, slot.no_deepstack()
                               if deepstack is None else deepstack)
            seq.fed += len(embeds)
        assert logits is not None, "a lease always leaves the last prompt row to feed"
        seq.t_prefill = time.perf_counter()
        seq.token = seq.decoding.accept(logits)
        model.write_rows(seq.lease.blocks, seq.cached, slot.rows_from(seq.cached))
    finally:
        slot.reset()
    return True


class BatchRunner:
    """The step loop over one paged model and its block pool."""

    def __init__(self, model: PagedModel, pool: BlockPool, max_batch_tokens: int,
                 chunk: int, on_step: Callable[[int, int], None] | None = None,
                 runtime: str = "openvino") -> None:
        self.model = model
        self.runtime = runtime  # the paged model's, for status and metrics
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.chunk = chunk  # rows of one prompt per step at most
        self.on_step = on_step  # (sequences, prefill rows) after every step
        # (runtime, prompt rows) whenever a runtime computed prompt rows: the step's, or
        # another's (prefill_outside).
        self.on_prefill: Callable[[str, int], None] | None = None
        self._cond = threading.Condition()
        self._incoming: list[BatchSequence] = []
        self._running: list[BatchSequence] = []
        # Prompts being prefilled by another runtime, before they join: shown in status.
        self._outside: dict[BatchSequence, str] = {}
        self.steps = 0
        self.peak_sequences = 0  # the most sequences one step has run
        # Started by the first sequence, gone when none is left: an engine replaced by a
        # reload leaves no thread (and no model) behind.
        self._thread: threading.Thread | None = None

    # -- the caller's side ------------------------------------------------------------

    def run(self, seq: BatchSequence) -> Outcome:
        """Run ``seq`` to its end with the others; blocks the calling thread."""
        if not seq.prefilling:  # prefilled elsewhere: its blocks are now worth sharing
            self.pool.publish(seq.lease, seq.keys, seq.owner, seq.fed)
            if seq.token is None:  # and done at its first token
                self._end(seq)
                assert seq.outcome is not None
                return seq.outcome
        with self._cond:
            self._incoming.append(seq)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="qvld-step",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
        seq.done.wait()
        if seq.error is not None:
            raise seq.error
        assert seq.outcome is not None
        return seq.outcome

    def prefill_outside(self, slot: RowsSlot, seq: BatchSequence, runtime: str) -> bool:
        """``prefill_elsewhere`` on ``slot`` (of ``runtime``), shown among the sequences
        while it runs and counted as that runtime's prompt rows."""
        with self._cond:
            self._outside[seq] = runtime
        try:
            return prefill_elsewhere(slot, self.model, seq, self.chunk)
        finally:
            with self._cond:
                del self._outside[seq]
            if self.on_prefill is not None and seq.fed > seq.cached:
                self.on_prefill(runtime, seq.fed - seq.cached)

    @property
    def busy_since(self) -> float | None:
        return self.model.busy_since

    def _everyone(self) -> list[tuple[BatchSequence, str]]:
        with self._cond:
            return [*self._outside.items(),
                    *((s, self.runtime) for s in (*self._running, *self._incoming))]

    def sequences(self) -> list[dict[str, Any]]:
        """Each generation, prefilled elsewhere or running: rows fed, tokens so far, state
        and the runtime computing it, for status."""
        return [{"uid": s.uid, "prompt_tokens": len(s.prompt.ids), "cached_tokens": s.cached,
                 "fed_tokens": s.fed, "generated_tokens": len(s.decoding.text.ids),
                 "state": "prefill" if s.prefilling else "decode", "runtime": runtime}
                for s, runtime in self._everyone()]

    def counts(self) -> tuple[int, int]:
        """(decoding, prefilling) sequences, those prefilled by another runtime included."""
        seqs = [s for s, _ in self._everyone()]
        prefilling = sum(1 for s in seqs if s.prefilling)
        return len(seqs) - prefilling, prefilling

    # -- the step thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._incoming and not self._running:
                    self._thread = None
                    return
                self._running.extend(self._incoming)
                self._incoming.clear()
            try:
                self._step()
            except Exception as exc:  # a runtime failure: every sequence in it fails
                log.exception("batched step failed")
                with self._cond:
                    failed = list(self._running)
                for seq in failed:
                    self._end(seq, exc)

    def _plan(self) -> list[tuple[BatchSequence, int]]:
        """Who feeds how many rows this step: decoders first, then prompt chunks."""
        plan: list[tuple[BatchSequence, int]] = []
        for seq in list(self._running):
            if seq.decoding.should_stop():
                seq.decoding.cancel()
                self._end(seq)
            elif not seq.prefilling:
                plan.append((seq, 1))
        budget = self.max_batch_tokens - len(plan)
        for seq in self._running:
            if budget <= 0:
                break
            if seq.prefilling:
                n = min(budget, self.chunk, len(seq.prompt.ids) - seq.fed)
                plan.append((seq, n))
                budget -= n
        return plan

    def _step(self) -> None:
        plan = self._plan()
        if not plan:
            return
        decoders = [seq for seq, n in plan if not seq.prefilling]
        embeds, positions, masks, deepstacks = [], [], [], []
        if decoders:
            ids = np.array([seq.token for seq in decoders], dtype=np.int64)
            embeds.append(self.model.embed(ids))
            pos = np.array([seq.fed + seq.prompt.rope_delta for seq in decoders], np.int64)
            positions.append(np.broadcast_to(pos, (3, len(decoders))))
            masks.append(np.zeros(len(decoders), dtype=bool))
        prefill_rows = 0
        for seq, n in plan[len(decoders):]:
            e, p, m, d = seq.rows(n)
            embeds.append(e)
            positions.append(p)
            masks.append(m)
            if d is not None:
                deepstacks.append(d)
            prefill_rows += n
        counts = np.array([n for _, n in plan], dtype=np.int32)
        past = np.array([seq.fed for seq, _ in plan], dtype=np.int32)
        tables = [seq.lease.blocks[:self.pool.blocks_for(seq.fed + n)] for seq, n in plan]
        logits = self.model.step(
            np.concatenate(embeds), np.concatenate(positions, axis=1), np.concatenate(masks),
            np.concatenate(deepstacks, axis=1) if deepstacks else self.model.no_deepstack(),
            past, np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            np.concatenate([[0], np.cumsum([len(t) for t in tables])]).astype(np.int32),
            np.concatenate(tables).astype(np.int32))
        self.steps += 1
        self.peak_sequences = max(self.peak_sequences, len(plan))
        now = time.perf_counter()
        for i, (seq, n) in enumerate(plan):
            if seq.token is not None and not seq.prefilling:
                seq.keys.append((seq.token, None))
            seq.fed += n
            self.pool.publish(seq.lease, seq.keys, seq.owner, seq.fed)
            if seq.prefilling:
                continue
            if not seq.t_prefill:
                seq.t_prefill = now
            try:
                seq.token = seq.decoding.accept(np.array(logits[i]))
            except Exception as exc:  # this sequence's sampling or streaming only
                self._end(seq, exc)
                continue
            if seq.token is None:
                self._end(seq)
        if self.on_step is not None:
            self.on_step(len(plan), prefill_rows)
        if self.on_prefill is not None and prefill_rows:
            self.on_prefill(self.runtime, prefill_rows)

    def _end(self, seq: BatchSequence, error: BaseException | None = None) -> None:
        with self._cond:
            if seq in self._running:
                self._running.remove(seq)
        self.pool.release(seq.lease)
        if error is None:
            seq.outcome = seq.decoding.outcome(seq.t0, seq.t_prefill or time.perf_counter(),
                                               seq.cached)
        seq.error = error
        seq.done.set()
