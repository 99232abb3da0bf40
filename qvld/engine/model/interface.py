"""What a runtime hands the engine: ``Models`` (the five submodels, loaded) and ``Slot``s
(the vision models, the embeddings, and a language model with one sequence's KV cache),
``PagedModel`` (the language model the step loop runs, over KV blocks), plus
``SlotBase``, the bookkeeping every backend's slot shares. The runtimes (``openvino``,
``onnxruntime``) implement these; ``backend`` picks one and pools its slots. Imports no
runtime.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np


class Slot(Protocol):
    """One generation's runners and KV cache."""

    past_len: int
    # When the inference call now running started (the watchdog looks at it).
    busy_since: float | None
    # Where prompts are prefilled when another runtime does it (model.prompt_backend).
    prompt_slot: RowsSlot | None

    def reset(self) -> None: ...

    def trim(self, keep: int) -> None:
        """Keep the first ``keep`` positions of the KV cache."""

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [S] -> embeddings [S,H] (a copy the caller may change)."""

    def step(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
             deepstack: np.ndarray) -> np.ndarray:
        """Run the LM on ``embeds`` [S,H] after ``past_len`` cached positions.

        positions [3,S]; visual_mask [S] bool; deepstack [k,Nvis,H] for the masked rows
        (``no_deepstack()`` when there are none). Returns the last position's logits [V],
        in a buffer the next step overwrites (copy it to keep it).
        """

    def no_deepstack(self) -> np.ndarray: ...

    def vision_patches(self, patches: np.ndarray) -> np.ndarray: ...

    def vision_positions(self, corner_ids: np.ndarray) -> np.ndarray: ...

    def vision_merge(self, hidden: np.ndarray, mask: np.ndarray,
                     rotary: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...


class RowsSlot(Slot, Protocol):
    """A slot whose KV cache can be loaded from and read out as arrays: it runs
    sequences behind ``slot_paged.SlotPaged`` (a runtime without paged attention), or
    prefills prompts for another runtime's paged cache (``model.prompt_backend``)."""

    def load_rows(self, kv: list[np.ndarray]) -> None:
        """Replace the cache with ``kv`` (f32 [1, heads, rows, head_dim], key then value
        per layer); ``past_len`` becomes its row count."""

    def rows_from(self, start: int) -> list[np.ndarray]:
        """The cache's rows [start:] (same layout); they may be views of the cache,
        valid until the next ``step``, ``trim`` or ``reset``."""


class BatchSlot(RowsSlot, Protocol):
    """A slot whose cache holds several sequences side by side, each at its own length,
    and steps them in one inference: the decode lane of ``slot_paged.SlotPaged`` (ONNX
    Runtime's graphs take the KV cache as batched inputs)."""

    def load_batch(self, lengths: list[int],
                   fill: Callable[[int, list[np.ndarray]], None]) -> None:
        """Replace the cache with ``len(lengths)`` sequences: ``fill(i, rows)`` writes
        sequence i's rows into ``rows``, one ``[heads, lengths[i], head_dim]`` array per
        cache (views of the slot's own buffers)."""

    def step_batch(self, embeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One new row per sequence (``embeds`` [B,1,H], ``positions`` [3,B,1]) after
        its rows; the logits [B,V] (a copy)."""

    def new_rows(self) -> list[np.ndarray]:
        """The rows the last ``step_batch`` added: [B, heads, 1, head_dim] per cache."""


class SlotBase:
    """What every backend's slot keeps beside its KV cache, and how it is cut back.

    Subclasses say how their cache is dropped and truncated; the bookkeeping (length,
    the watchdog's clock) and the step buffers allocated once
    (the attention mask, the empty deepstack, the logits handed to the sampler) are the
    same for all.
    """

    def __init__(self, deepstack_layers: int, hidden_size: int) -> None:
        self.past_len = 0
        self.busy_since: float | None = None
        # Where this slot's prompts are prefilled when another runtime does it.
        self.prompt_slot: RowsSlot | None = None
        self._ones = np.ones((1, 4096), dtype=np.int64)
        self._no_deepstack = np.zeros((deepstack_layers, 1, hidden_size), np.float32)
        self._logits = np.zeros(0, dtype=np.float32)

    def _drop_cache(self) -> None:
        raise NotImplementedError

    def _truncate_cache(self, keep: int) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        self._drop_cache()
        self.past_len = 0

    def trim(self, keep: int) -> None:
        """Keep the first ``keep`` positions of the KV cache."""
        if keep <= 0:
            self.reset()
            return
        if keep < self.past_len:
            self._truncate_cache(keep)
            self.past_len = keep

    @contextmanager
    def _running(self) -> Iterator[None]:
        """Marks an inference call as running, for the watchdog."""
        self.busy_since = time.monotonic()
        try:
            yield
        finally:
            self.busy_since = None

    def _attention_mask(self, total: int) -> np.ndarray:
        """[1, total] ones: a view of one buffer, which grows by doubling (rarely)."""
        if total > self._ones.shape[1]:
            self._ones = np.ones((1, max(total, 2 * self._ones.shape[1])), dtype=np.int64)
        return self._ones[:, :total]

    def _keep_logits(self, last: np.ndarray) -> np.ndarray:
        """``last`` copied into the buffer ``step`` returns: the sampler may change it,
        the runtime's own output stays intact."""
        if self._logits.shape != last.shape:
            self._logits = np.empty(last.shape, dtype=np.float32)
        np.copyto(self._logits, last)
        return self._logits

    def no_deepstack(self) -> np.ndarray:
        return self._no_deepstack


class PagedModel(Protocol):
    """The language model in paged-attention form (continuous batching): one step runs
    the packed rows of several sequences over a KV cache of fixed-size blocks."""

    block_size: int
    num_blocks: int
    cache_bytes: int
    # When the step now running started (the watchdog looks at it).
    busy_since: float | None
    # Whether a step's decoding sequences run in one inference (continuous batching).
    batches_decoding: bool

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [S] -> embeddings [S,H] (a copy)."""

    def no_deepstack(self) -> np.ndarray: ...

    def step(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
             deepstack: np.ndarray, past_lens: np.ndarray, begins: np.ndarray,
             block_begins: np.ndarray, block_indices: np.ndarray) -> np.ndarray:
        """Logits [sequences, V] of each sequence's last row in the pack."""

    # Whether ``read_rows``/``write_rows`` work (a plain float cache layout).
    rows_accessible: bool

    def read_rows(self, blocks: list[int], count: int) -> list[np.ndarray]:
        """A sequence's first ``count`` rows (``RowsSlot.load_rows``' layout)."""

    def write_rows(self, blocks: list[int], start: int, kv: list[np.ndarray]) -> None:
        """Store a sequence's rows from ``start`` on (``RowsSlot.rows_from``' layout)."""


class Models(Protocol):
    """A model directory's submodels, loaded and ready to run."""

    kv_bytes_per_token: int
    # Files whose mapped pages may be dropped once the runtime holds its own copy.
    weight_files: set[str]
    # Which runtime runs the model ("openvino", "onnxruntime") and its version: nothing
    # above the engine imports a runtime to ask.
    runtime: str
    runtime_version: str
    # What the runtime actually runs with (logged, reported by status and metrics).
    runtime_properties: dict[str, str]

    # Whether the language model runs in paged-attention form (every scheduled
    # sequence's rows in one inference); without it ``new_paged`` puts slots behind
    # ``slot_paged.SlotPaged`` (one sequence per inference): the step loop runs either.
    paged: bool
    kv_block_size: int  # rows per KV block

    # The runtime that encodes images and prefills prompts when it is not this one
    # (``model.prompt_backend``), else None.
    prompt: Models | None

    def new_slot(self) -> Slot: ...

    def new_paged(self, num_blocks: int, slots: int) -> PagedModel:
        """The step loop's model over ``num_blocks`` KV blocks (``slots``: how many
        sequences' caches a runtime without paged attention keeps at once)."""
