"""Prompt prefills on another runtime (``model.prompt_backend``): ONNX Runtime feeds an
admitted sequence's prompt rows, then the rows are copied into the paged cache, where
OpenVINO's steps decode on from them.

Why two runtimes (measured in BENCHMARKS.md): ONNX Runtime's int8 MatMuls prefill a
prompt in about half OpenVINO's time on a CPU without VNNI, where OpenVINO multiplies in
f32; OpenVINO keeps decoding, where continuous batching runs every generation's next
token in one pass over the weights.

``PromptPrefills`` runs them on a lane of its own (``lane.Lane``: the thread
``qvld-prefill``) with a prompt slot of its own, one at a time (each runs on every core),
in the order the step loop admitted them: the scheduler already decided who goes first,
so an admitted sequence, holding its place and blocks, never waits for a slot worker
behind other users' image encodes. While a sequence is
here it is ``outside``: the step loop does not touch it until ``joined`` is posted back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from qvld.engine.loop.lane import Lane
from qvld.engine.loop.sequence import Sequence
from qvld.engine.model.interface import PagedModel, RowsSlot

# (sequence, fed to the end, error): posted back to the step loop's inbox.
Joined = Callable[[Sequence, bool, BaseException | None], None]


def prefill_elsewhere(slot: RowsSlot, model: PagedModel, seq: Sequence, chunk: int) -> bool:
    """Feed ``seq``'s prompt rows on ``slot`` (another runtime: model.prompt_backend),
    starting from its shared prefix read out of the paged cache; take its first token
    from the last row's logits, then copy the new rows into its own blocks (after the
    token went out: the copy is not in the time to it). False when it should stop."""
    start = seq.fed
    slot.load_rows(model.read_rows(seq.lease.blocks, start))
    try:
        logits = None
        while seq.prefilling:
            if seq.decoding.should_stop():
                return False
            embeds, positions, mask, deepstack = seq.rows(
                min(chunk, len(seq.keys) - seq.fed), model.embed)
            logits = slot.step(embeds, positions, mask, slot.no_deepstack()
                               if deepstack is None else deepstack)
            seq.fed += len(embeds)
        assert logits is not None, "a lease always leaves the last prompt row to feed"
        seq.t_prefill = time.perf_counter()
        if seq.awaits_format:  # the step loop chooses the token when the compile ends
            seq.logits = np.array(logits)
        else:
            seq.take(seq.decoding.accept(logits))
        model.write_rows(seq.lease.blocks, start, slot.rows_from(start))
    finally:
        slot.reset()
    return True


class PromptPrefills:
    def __init__(self, slot: RowsSlot, model: PagedModel, chunk: int, runtime: str,
                 joined: Joined) -> None:
        self.slot = slot
        self.model = model
        self.chunk = chunk
        self.runtime = runtime  # the prompt runtime's name, for status and metrics
        self.joined = joined
        self._lane = Lane("qvld-prefill")

    @property
    def busy_since(self) -> float | None:
        """When the runtime call now running began (the watchdog's stuck check)."""
        return self.slot.busy_since

    def submit(self, seq: Sequence) -> None:
        """Prefill ``seq`` after those handed over before it; ``joined`` tells the end."""
        self._lane.submit(lambda: self._prefill(seq))

    def _prefill(self, seq: Sequence) -> None:
        fed, error = False, None
        try:  # one that stopped while it waited here is dropped unfed
            if not seq.decoding.should_stop():
                fed = prefill_elsewhere(self.slot, self.model, seq, self.chunk)
        except Exception as exc:  # the runtime failed: this sequence ends with it
            error = exc
        self.joined(seq, fed, error)
