"""How a generation reaches the step loop once a slot worker has it.

``LoopRunner.start(job)`` runs on the slot worker's thread: the prompt's cached prefix
held (the block pool's hash chain: the one prefix cache), its images encoded and rows
embedded on the slot, then the ``Sequence`` handed to the step loop
(``loop.step_loop.StepLoop``), whatever runtime runs the language model. The end comes
through ``job.done(ran, error)`` (``ran`` None: stopped before an answer), later, on
the step thread; or ``start`` raises ``HistoryLost`` without calling it when a session
history could not be rebuilt (its images' bytes and embeddings are gone; the engine
then starts the session afresh and calls ``start`` again). A prompt prefilled by
another runtime (``model.prompt_backend``) is prefilled once admitted by the loop's
``PromptPrefills`` (a thread and slot of its own), not by a slot worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from qvld.engine.decoding.generation import Decoding, Outcome, Prompt, never
from qvld.engine.inputs.prompt_builder import PromptBuilder, prompt_keys
from qvld.engine.inputs.sessions import TurnInputs
from qvld.engine.loop.sequence import Arrival, Sequence
from qvld.engine.loop.step_loop import StepLoop
from qvld.engine.model.backend import SlotPool
from qvld.engine.model.interface import Slot
from qvld.engine.types import GenerateResult

# The prompt as fed, the outcome, and when vision and generation started.
Ran = tuple[Prompt, Outcome, float, float]


@dataclass(eq=False)
class Generation:
    """A request in the engine, from ``Engine.submit`` until its ``future`` is settled:
    waiting for a slot worker, encoding, waiting for a place in the step loop, or
    running there."""

    uid: int
    stop_when: Callable[[], bool] = never
    future: Future[GenerateResult] = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None  # admitted to the step loop
    arrival: Arrival | None = None
    seq: Sequence | None = None
    slot_wait_s: float = 0.0
    t_start: float = 0.0
    # Called (at most once) when its prompt is in the shared KV cache: ``n`` > 1 starts
    # the other choices then, so that they reuse its prompt's blocks.
    on_prefilled: Callable[[], None] | None = None

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.stop_when()

    @property
    def stage(self) -> str:
        """queued (for a slot worker), encoding (on one: its turn, images and prompt),
        waiting (encoded, for a place in the step loop) or running."""
        if self.seq is not None and self.seq.admitted:
            return "running"
        if self.seq is not None:
            return "waiting"
        return "queued" if not self.t_start else "encoding"


@dataclass
class RunJob:
    """One attempt at a generation: its inputs, token choice, and whom to tell."""

    gen: Generation
    owner: int | None  # whose cached prefixes and images it may reuse
    inputs: TurnInputs
    decoding: Decoding
    max_tokens: int
    done: Callable[[Ran | None, BaseException | None], None]

    def assemble(self, prompts: PromptBuilder, slot: Slot, cached: int) -> Prompt | None:
        """The prompt laid out on ``slot``, its images after the ``cached`` rows encoded
        (None: stopped; HistoryLost: a history image cannot be rebuilt)."""
        inputs = self.inputs
        return prompts.assemble(slot, inputs.ids, inputs.images, inputs.starts,
                                self.decoding.should_stop, cached, self.owner, inputs.pinned)


class LoopRunner:
    def __init__(self, pool: SlotPool, prompts: PromptBuilder, batch: StepLoop,
                 max_context: int) -> None:
        self.pool = pool
        self.prompts = prompts
        self.batch = batch
        self.blocks = batch.pool
        self.max_context = max_context

    def start(self, job: RunJob) -> None:
        ids, decoding = job.inputs.ids, job.decoding
        lease = self.blocks.hold_prefix(prompt_keys(ids, job.inputs.images,
                                                    job.inputs.starts), job.owner)
        try:
            cached = lease.shared
            with self.pool.acquire() as slot:
                t_vision = time.perf_counter()
                prompt = job.assemble(self.prompts, slot, cached)
                if prompt is None:
                    self.blocks.release(lease)
                    job.done(None, None)
                    return
                embeds = slot.embed(np.asarray(ids[cached:]))
                visual = prompt.visual_mask[cached:]
                if visual.any():
                    rows_of = np.cumsum(prompt.visual_mask)[cached:][visual] - 1
                    embeds[visual] = prompt.visual_embeds[rows_of]
        except BaseException:
            self.blocks.release(lease)
            raise
        seq = Sequence(prompt=prompt, embeds=embeds, lease=lease, owner=job.owner,
                       decoding=decoding, uid=job.gen.uid,
                       max_rows=min(len(ids) + job.max_tokens, self.max_context),
                       prefill_outside=self.batch.prefills is not None)
        t_generate = seq.t0

        def on_done(seq: Sequence) -> None:
            job.gen.started = seq.admitted
            if seq.error is not None:
                job.done(None, seq.error)
            else:
                assert seq.outcome is not None
                job.done((seq.prompt, seq.outcome, t_vision, t_generate), None)

        seq.on_done = on_done
        seq.on_prefilled = job.gen.on_prefilled
        job.gen.seq = seq
        try:
            self.batch.submit(seq)
        except BaseException:
            self.blocks.release(lease)
            raise
