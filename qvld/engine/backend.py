"""The seam between the engine and an inference runtime (``model.backend``).

A backend loads the five submodels of a model directory (``Models``) and hands out
``Slot``s: everything one generation runs on, its KV cache included. Everything above
(images, prompts, positions, sampling, caches, sessions) is shared and talks only to these
two protocols. ``openvino`` (stateful KV cache inside infer requests) and ``onnxruntime``
(KV cache as explicit tensors bound to the session's inputs and outputs) implement them;
each runtime is imported only by its own module.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from qvld.config import EngineConfig, ModelConfig
from qvld.engine.model_dir import ModelSpec
from qvld.errors import ModelInvalid


class Slot(Protocol):
    """One generation's runners and KV cache."""

    past_len: int
    # (token id, image hash or None) per position held in the KV cache.
    history: list[tuple[int, bytes | None]]
    # When the inference call now running started (the watchdog looks at it).
    busy_since: float | None

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


class SlotBase:
    """What every backend's slot keeps beside its KV cache, and how it is cut back.

    Subclasses say how their cache is dropped and truncated; the bookkeeping (length,
    the prefix-cache keys, the watchdog's clock) and the step buffers allocated once
    (the attention mask, the empty deepstack, the logits handed to the sampler) are the
    same for all.
    """

    def __init__(self, deepstack_layers: int, hidden_size: int) -> None:
        self.past_len = 0
        self.history: list[tuple[int, bytes | None]] = []
        self.busy_since: float | None = None
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
        self.history = []

    def trim(self, keep: int) -> None:
        """Keep the first ``keep`` positions of the KV cache."""
        if keep <= 0:
            self.reset()
            return
        if keep < self.past_len:
            self._truncate_cache(keep)
            self.past_len = keep
        del self.history[keep:]

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


class Models(Protocol):
    """A model directory's submodels, loaded and ready to run."""

    kv_bytes_per_token: int
    # Files whose mapped pages may be dropped once the runtime holds its own copy.
    weight_files: set[str]
    # What the runtime actually runs with (logged, reported by status and metrics).
    runtime_properties: dict[str, str]

    def new_slot(self) -> Slot: ...


def load_models(spec: ModelSpec, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> Models:
    """The backend ``model.backend`` names, over the model directory ``spec`` describes."""
    if model_cfg.backend == "onnxruntime":
        try:
            from qvld.engine.onnxruntime import SessionModels
        except ImportError as exc:
            raise ModelInvalid("model.backend is onnxruntime but onnxruntime is not "
                               "installed: pip install 'qvld[onnxruntime]'") from exc
        return SessionModels(spec, model_cfg, engine_cfg)
    from qvld.engine.openvino import CompiledModels

    return CompiledModels(spec, model_cfg, engine_cfg)


def common_prefix(a: list[Any], b: list[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SlotPool:
    """Slots with their KV caches, kept as a prefix cache per owner.

    ``acquire(keys, owner)`` hands out the free slot whose history shares the longest
    prefix with ``keys`` among those ``owner`` filled (the least recently used one when
    none does, so that recent caches survive); a slot last filled by another owner is
    reset first, so its prefix counts as 0: whether a prefix was cached shows in a reply,
    and must not tell one user what another asked. The owner is a uid, or None for
    everyone when caches are shared. Retained KV caches beyond ``budget_tokens`` are
    evicted LRU. All slots are created up front: no allocation per request.
    """

    def __init__(self, models: Models, size: int, budget_tokens: int | None = None) -> None:
        self.slots = [models.new_slot() for _ in range(size)]
        self.budget_tokens = budget_tokens
        self._free: list[Slot] = list(self.slots)  # least recently used first
        self._owners: dict[int, int | None] = {id(slot): None for slot in self.slots}
        self._cond = threading.Condition()

    def _reusable(self, slot: Slot, keys: list[tuple[int, bytes | None]],
                  owner: int | None) -> int:
        return common_prefix(slot.history, keys) if self._owners[id(slot)] == owner else 0

    @contextmanager
    def acquire(self, keys: list[tuple[int, bytes | None]] | None = None,
                owner: int | None = None) -> Iterator[Slot]:
        with self._cond:
            while not self._free:
                self._cond.wait()
            best = max(range(len(self._free)),
                       key=lambda i: (self._reusable(self._free[i], keys or [], owner), -i))
            slot = self._free.pop(best)
            stale = self._owners[id(slot)] != owner
            self._owners[id(slot)] = owner
        try:
            if stale:
                slot.reset()  # another owner's KV cache: never a prefix for this one
            yield slot
        except BaseException:
            slot.reset()  # a failed run leaves the KV cache unknown
            raise
        finally:
            with self._cond:
                self._free.append(slot)
                self._evict()
                self._cond.notify()

    def _evict(self) -> None:
        """Drop the least recently used idle KV caches beyond the budget (lock held)."""
        if self.budget_tokens is None:
            return
        held = sum(slot.past_len for slot in self.slots)
        for slot in self._free:  # least recently used first
            if held <= self.budget_tokens:
                break
            held -= slot.past_len
            slot.reset()

    def cached_tokens(self) -> int:
        return sum(slot.past_len for slot in self.slots)


_MADV_DONTNEED = 4


def release_file_pages(files: set[str]) -> int:
    """Drop this process's resident pages of its read-only mappings of ``files``.

    A runtime maps the weight files and, on the first inference, repacks the weights into
    memory of its own; the mapped pages it read stay resident (and counted in RSS and the
    service's cgroup) beside the copy. They are clean: if anything reads them again the
    kernel faults them back in from the file. Returns the bytes of mappings advised.
    """
    if not files:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    released = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5] not in files or "w" in fields[1]:
            continue  # a writable private mapping may hold changes: never dropped
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) == 0:
            released += hi - lo
    return released
