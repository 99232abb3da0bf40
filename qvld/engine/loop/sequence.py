"""One generation as the step loop sees it: data, owned by no thread.

An ``Arrival`` is a generation waiting for a slot to encode its images. A ``Sequence``
is made once its prompt is embedded (images encoded, prompt rows looked
up), holding the KV blocks of its cached prefix (``Lease``). The scheduler
(``scheduler.StepScheduler``) admits it, gives it blocks, plans its rows each step and
may preempt it; the step loop (``batch.StepLoop``) feeds its rows and samples its
tokens through its ``Decoding``; when it ends, ``on_done`` is called once, on the step
thread, with ``outcome`` or ``error`` set.

Rows: ``keys`` names every row that is or will be in the KV cache (the prompt's, then
each generated token once it has been fed); ``fed`` of them are. A sequence is
*prefilling* while ``fed < len(keys)``: its prompt at first, a run of tokens a response
format forced (fed in one step, as a prompt chunk is), and after a preemption the rows
it must compute again (generated tokens included); the last row's logits then choose
its next token. A decoding sequence holds that token (``token``) until the step that
feeds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qvld.engine.decoding.generation import Decoding, Outcome, Prompt
from qvld.engine.loop.blocks import Lease, RowKey


@dataclass(eq=False)  # an identity: compared by who it is
class Arrival:
    """A generation before it is a ``Sequence``: its images still to encode and its
    prompt rows to embed. The scheduler queues it with everything else and starts its
    ``encode`` (on a slot worker, beside the steps) when a slot is free and its user's
    turn has come; ``encode`` hands the ``Sequence`` it builds to the loop (or settles
    the generation), and ``drop`` ends one stopped before it was started."""

    uid: int
    should_stop: Callable[[], bool]
    encode: Callable[[], None]
    drop: Callable[[], None]
    arrived: float = field(default_factory=time.monotonic)


@dataclass(eq=False)  # an identity: kept in lists and queues, compared by who it is
class Sequence:
    prompt: Prompt
    embeds: np.ndarray  # [len(ids) - cached, H]: the prompt rows after the cached prefix
    lease: Lease
    owner: int | None  # whose published blocks it may reuse (None: everyone's)
    decoding: Decoding
    uid: int = 0  # who asked: fairness is between uids, status shows a user their own
    max_rows: int = 0  # rows it may take in all (prompt + max_tokens, within the context)
    on_done: Callable[[Sequence], None] | None = None
    # Called once on the step thread when its prompt is in the KV cache (its full blocks
    # published): other choices of the same prompt may then share them.
    on_prefilled: Callable[[], None] | None = None
    # Prefilled by another runtime (model.prompt_backend) once admitted.
    prefill_outside: bool = False
    # That prefill, or a choice of its next token (``slow_choice``), is running on
    # another thread: not in the step's plan, not stopped or preempted until it is back.
    outside: bool = False
    # Its response format's matcher took long over one token: its next tokens are
    # chosen on the step loop's matcher lane, beside the steps, not in them.
    slow_choice: bool = False
    ended: bool = False  # ``on_done`` was called
    fed: int = 0
    keys: list[RowKey] = field(default_factory=list)
    token: int | None = None  # chosen, not yet fed (nothing else is waiting to be)
    t0: float = field(default_factory=time.perf_counter)
    t_prefill: float = 0.0
    submitted: float = field(default_factory=time.monotonic)
    admitted: float | None = None  # first admitted to the running set
    preemptions: int = 0
    # Its prompt's last logits, kept while its response format still compiles: the
    # first token is chosen from them when the compile ends (``StepLoop``).
    logits: np.ndarray | None = None
    outcome: Outcome | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        # Rows of the prefix found cached: ``embeds`` starts after those held when it
        # was made; ``cached`` grows to what admission found (reported as reused).
        self.embeds_from = self.cached = self.fed = self.lease.shared
        self.keys = list(self.prompt.keys)
        self.max_rows = self.max_rows or len(self.keys) + 1
        self._vis_index = np.cumsum(self.prompt.visual_mask) - 1

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.keys)

    @property
    def in_prompt(self) -> bool:
        """Its prompt is not all fed yet (status calls it prefilling)."""
        return self.fed < len(self.prompt.ids)

    def take(self, tokens: list[int] | None) -> None:
        """The tokens its decoding chose to feed next: one is its ``token``; a run (a
        response format forced the rest) becomes rows to feed together."""
        if tokens is None:
            return
        if len(tokens) == 1 and not self.prefilling:
            self.token = tokens[0]
        else:
            self.keys.extend((token, None) for token in tokens)

    @property
    def awaits_format(self) -> bool:
        """Its first token would wait for a response format still compiling."""
        constraint = self.decoding.constraint
        return constraint is not None and not self.generated and not constraint.ready

    @property
    def generated(self) -> int:
        return len(self.decoding.text.ids)

    def rows(self, n: int, embed: Callable[[np.ndarray], np.ndarray]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """The next ``n`` rows to feed: embeddings, positions [3,n], visual mask,
        deepstack (None without visual rows). Prompt rows come from the prompt; rows of
        generated tokens (recomputed after a preemption) are embedded by ``embed``."""
        lo, hi = self.fed, self.fed + n
        prompt_len = len(self.prompt.ids)
        embeds, positions, masks = [], [], []
        deepstack = None
        if lo < prompt_len:
            top = min(hi, prompt_len)
            mask = self.prompt.visual_mask[lo:top]
            if mask.any():
                deepstack = self.prompt.deepstack[:, self._vis_index[lo:top][mask]]
            embeds.append(self.embeds[lo - self.embeds_from:top - self.embeds_from])
            positions.append(self.prompt.positions[:, lo:top])
            masks.append(mask)
        if hi > prompt_len:
            start = max(lo, prompt_len)
            ids = np.array([token for token, _ in self.keys[start:hi]], dtype=np.int64)
            embeds.append(embed(ids))
            at = np.arange(start, hi, dtype=np.int64) + self.prompt.rope_delta
            positions.append(np.broadcast_to(at, (3, hi - start)))
            masks.append(np.zeros(hi - start, dtype=bool))
        if len(embeds) == 1:
            return embeds[0], positions[0], masks[0], deepstack
        return (np.concatenate(embeds), np.concatenate(positions, axis=1),
                np.concatenate(masks), deepstack)

    def prefilled(self) -> None:
        """Its prompt is in the KV cache: tell ``on_prefilled``, once."""
        hook, self.on_prefilled = self.on_prefilled, None
        if hook is not None:
            hook()

    def preempted(self) -> None:
        """Back to waiting: the token sampled but not fed becomes a row to compute again
        (its logits then choose the next token, as its decode step would have), and
        every row after the shared prefix will be fed again (``fed`` is set on
        readmission, from the blocks found still cached)."""
        if self.token is not None:
            self.keys.append((self.token, None))
            self.token = None
        self.logits = None  # computed again with its rows
        self.fed = self.cached
        self.preemptions += 1
