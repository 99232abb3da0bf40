"""The seam between the engine and an inference runtime (``model.backend``).

A backend loads the five submodels of a model directory (``Models``) and hands out
``Slot``s (the vision models, the embeddings, a language model with one sequence's KV
cache) and the step loop's ``PagedModel``. Everything above (images, prompts, positions,
sampling, caches, sessions, scheduling) is shared and talks only to these protocols (in
``interface``). Which runtime does what:

- ``openvino``: every submodel; the language model in paged-attention form (every
  scheduled sequence's rows in one inference over the KV blocks), or with
  ``engine.continuous_batching: false`` stateful (the KV cache inside an infer request)
  behind ``slot_paged.SlotPaged``.
- ``onnxruntime``: every submodel, the KV cache as tensors bound to the language
  model's inputs and outputs, behind ``SlotPaged``; or, as the prompt backend beside
  OpenVINO (``model.prompt_backend``), the vision models and prompt prefills, whose
  rows are copied into OpenVINO's paged cache.

Each runtime is imported only by its own module, and only here.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qvld.config import EngineConfig, ModelConfig
from qvld.engine.model.interface import Models, Slot
from qvld.engine.model.model_dir import (
    VISION_SUBMODELS,
    ModelSpec,
    onnx_outdated,
    onnx_path,
    onnx_weights,
)
from qvld.errors import ModelInvalid


def load_models(spec: ModelSpec, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> Models:
    """The backend ``model.backend`` names, over the model directory ``spec`` describes,
    with the prompt backend ``model.prompt_backend`` resolves to attached."""
    if model_cfg.backend == "onnxruntime":
        session_models: Models = _session_models()(spec, model_cfg, engine_cfg)
        return session_models
    from qvld.engine.model.openvino import CompiledModels

    prompt = _prompt_models(spec, model_cfg, engine_cfg)
    if prompt is None:
        return CompiledModels(spec, model_cfg, engine_cfg)
    # Images and prompts on ONNX Runtime: OpenVINO compiles no vision models, and keeps
    # its paged KV cache at f16 (unless set otherwise) so prefilled rows can be copied in.
    models = CompiledModels(spec, model_cfg, engine_cfg, vision=False, kv_cache_precision="f16")
    models.prompt = prompt
    models.weight_files |= prompt.weight_files
    models.runtime_properties["PROMPT_BACKEND"] = (
        f"onnxruntime {prompt.runtime_version} (weights {prompt.runtime_properties['WEIGHTS']})")
    return models


def _prompt_models(spec: ModelSpec, model_cfg: ModelConfig, engine_cfg: EngineConfig
                   ) -> Models | None:
    """ONNX Runtime's vision and language models when model.prompt_backend resolves to
    onnxruntime, else None. auto: onnxruntime where it is installed, the directory also
    holds ONNX graphs of the vision and language models with int8 weights (``qvlctl
    model export-onnx CHECKPOINT DIR --weights int8``) and generations are batched (the
    prefilled rows go into the paged cache).

    Measured (BENCHMARKS.md): ONNX Runtime's int8 MatMuls (u8 x s8 integer dot products,
    on any AVX2 CPU) encode an image and prefill a prompt in about half OpenVINO's time
    on a CPU without VNNI, where OpenVINO multiplies in f32 (its dynamic quantisation
    needs VNNI or AMX), and in 0.64-0.72x of it with AMX. OpenVINO keeps decoding:
    continuous batching runs every generation's next token in one pass over the weights."""
    choice = model_cfg.prompt_backend
    graphs = all(onnx_path(spec.path, sub).is_file()
                 for sub in (*VISION_SUBMODELS, "language_model"))
    if choice == "onnxruntime" and not graphs:
        raise ModelInvalid(f"model.prompt_backend is onnxruntime but {spec.path} holds no "
                           "ONNX graphs: `qvlctl model export-onnx CHECKPOINT "
                           f"{spec.path} --weights int8` writes them beside the IR")
    if choice == "auto":
        # Float graphs are no faster than OpenVINO's: only int8 ones are worth loading.
        if not (graphs and engine_cfg.continuous_batching
                and onnx_weights(onnx_path(spec.path, "language_model")) == "int8"
                and not onnx_outdated(spec.path)):
            return None
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            return None
    elif choice == "openvino":
        return None
    # ONNX Runtime computes at f32 with an f32 KV cache whatever OpenVINO is set to.
    onnx_cfg = model_cfg.model_copy(update={"precision": "auto", "kv_cache_precision": "auto"})
    prompt: Models = _session_models()(spec, onnx_cfg, engine_cfg,
                                       submodels=(*VISION_SUBMODELS, "language_model"),
                                       beside=True)
    return prompt


def _session_models() -> Any:
    try:
        from qvld.engine.model.onnxruntime import SessionModels
    except ImportError as exc:
        raise ModelInvalid("onnxruntime is not installed (model.backend or "
                           "model.prompt_backend names it): pip install "
                           "'qvld[onnxruntime]'") from exc
    return SessionModels


class SlotPool:
    """The slots that encode images and embed prompts (one per slot worker; the step
    loop's model has slots of its own): ``acquire`` hands out a free one, waiting for
    one when all are taken. All are created up front: no allocation per request."""

    def __init__(self, models: Models, size: int) -> None:
        self.slots = [models.new_slot() for _ in range(size)]
        self._free: list[Slot] = list(self.slots)
        self._cond = threading.Condition()

    @contextmanager
    def acquire(self) -> Iterator[Slot]:
        with self._cond:
            while not self._free:
                self._cond.wait()
            slot = self._free.pop()
        try:
            yield slot
        finally:
            with self._cond:
                self._free.append(slot)
                self._cond.notify()


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
