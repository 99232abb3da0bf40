"""The only module that imports openvino: read, adapt, compile, and run the submodels.

Every submodel is compiled once. A ``Slot`` bundles one infer request per submodel so
that one generation owns everything it runs on; the ``SlotPool`` holds
``engine.infer_requests`` of them, created up front (no allocation per request).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from qvld.config import EngineConfig, ModelConfig
from qvld.engine.model_dir import ModelSpec
from qvld.errors import ModelInvalid

log = logging.getLogger("qvld.engine")

# Ops that may sit between the lm_head MatMul and the logits output.
_PASS_THROUGH = {"Convert", "Multiply", "Divide", "Add", "Tanh"}


def slice_logits_to_last_position(model: ov.Model) -> bool:
    """Make the LM compute logits for the last position only.

    The export computes logits for every prompt position ([B,S,V]); a slice of the
    hidden states before the lm_head MatMul turns that into [B,1,V]. Returns whether
    the graph was changed (False if it has no recognisable lm_head).
    """
    node = model.output("logits").get_node().input_value(0).get_node()
    while node.get_type_name() in _PASS_THROUGH:
        node = node.input_value(0).get_node()
    if node.get_type_name() != "MatMul":
        return False
    hidden = node.input_value(0)
    if hidden.get_partial_shape().rank.get_length() != 3:
        return False
    last = ops.slice(
        hidden,
        np.array([-1], dtype=np.int64),
        np.array([np.iinfo(np.int64).max], dtype=np.int64),
        np.array([1], dtype=np.int64),
        np.array([1], dtype=np.int64),
    )
    node.input(0).replace_source_output(last.output(0))
    model.validate_nodes_and_infer_types()
    return True


def usable_cache_dir(path: Path) -> bool:
    """Whether the compiled-model cache can be written; if not, serve without it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as exc:
        log.warning("model.cache_dir %s is not usable (%s); compiling without a cache",
                    path, exc.strerror or exc)
        return False
    if shutil.disk_usage(path).free < 256 << 20:
        log.warning("model.cache_dir %s has less than 256 MiB free; compiling without a "
                    "cache", path)
        return False
    return True


def compile_properties(model_cfg: ModelConfig, engine_cfg: EngineConfig) -> dict[str, Any]:
    props: dict[str, Any] = {
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": str(engine_cfg.streams),
    }
    if engine_cfg.threads != "auto":
        props["INFERENCE_NUM_THREADS"] = int(engine_cfg.threads)
    if model_cfg.precision != "auto":
        props["INFERENCE_PRECISION_HINT"] = model_cfg.precision
    if model_cfg.kv_cache_precision != "auto":
        props["KV_CACHE_PRECISION"] = model_cfg.kv_cache_precision
    if model_cfg.dynamic_quantization != "auto":
        props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = (
            0 if model_cfg.dynamic_quantization == "off" else int(model_cfg.dynamic_quantization))
    return props


class CompiledModels:
    """The compiled submodels of one model directory."""

    def __init__(self, spec: ModelSpec, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> None:
        core = ov.Core()
        if model_cfg.cache_dir is not None and usable_cache_dir(model_cfg.cache_dir):
            core.set_property({"CACHE_DIR": str(model_cfg.cache_dir)})
        props = compile_properties(model_cfg, engine_cfg)

        def load(submodel: str) -> ov.Model:
            path = spec.ir(submodel)
            try:
                return core.read_model(path)
            except RuntimeError as exc:
                raise ModelInvalid(f"{path.name} (or its .bin) cannot be read: "
                                   f"{_last_line(exc)}") from exc

        def compile_model(model: ov.Model, submodel: str) -> ov.CompiledModel:
            try:
                return core.compile_model(model, model_cfg.device, props)
            except RuntimeError as exc:
                raise ModelInvalid(f"openvino_{submodel}.xml cannot be compiled: "
                                   f"{_last_line(exc)}") from exc

        lm = load("language_model")
        self.logits_sliced = slice_logits_to_last_position(lm)
        self.language = compile_model(lm, "language_model")
        self.embeddings = compile_model(load("text_embeddings_model"), "text_embeddings_model")
        self.vision = compile_model(load("vision_embeddings_model"), "vision_embeddings_model")
        self.vision_pos = compile_model(load("vision_embeddings_pos_model"),
                                        "vision_embeddings_pos_model")
        self.vision_merger = compile_model(load("vision_embeddings_merger_model"),
                                           "vision_embeddings_merger_model")
        self.hidden_size = spec.hidden_size
        self.deepstack_layers = spec.vision.deepstack_layers
        kv_type = self.language.get_property("KV_CACHE_PRECISION")
        kv_bytes = max(1, (kv_type.bitwidth + 7) // 8) if hasattr(kv_type, "bitwidth") else 2
        # keys and values, every layer, every KV head.
        self.kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_bytes
        self.runtime_properties = {
            key: _text(self.language.get_property(key))
            for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS",
                        "DYNAMIC_QUANTIZATION_GROUP_SIZE")
        }


def _sequence_axis(shape: Any, length: int) -> int:
    """The KV state's sequence axis: [batch, kv_heads, seq, head_dim] in these exports."""
    if len(shape) == 4 and shape[2] == length:
        return 2
    matches = [i for i, n in enumerate(shape) if n == length]
    if not matches:
        raise RuntimeError(f"no axis of length {length} in a KV state of shape {shape}")
    return matches[-1]


def common_prefix(a: list[Any], b: list[Any]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _last_line(exc: BaseException) -> str:
    """OpenVINO's messages span lines; the last non-empty one says what is wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _text(value: Any) -> str:
    """OpenVINO property values as short text (element types as 'bf16', 'u8', ...)."""
    return str(value.to_string()) if hasattr(value, "to_string") else str(value)


class Slot:
    """One generation's infer requests; the LM request holds a KV cache (stateful)."""

    def __init__(self, models: CompiledModels) -> None:
        self._models = models
        self._lm = models.language.create_infer_request()
        self._embed = models.embeddings.create_infer_request()
        self._vision = models.vision.create_infer_request()
        self._vision_pos = models.vision_pos.create_infer_request()
        self._merger = models.vision_merger.create_infer_request()
        self.past_len = 0
        # (token id, image hash or None) per position held in the KV cache.
        self.history: list[tuple[int, bytes | None]] = []
        # When the infer call now running started (the watchdog looks at it).
        self.busy_since: float | None = None

    def _infer(self, request: Any, inputs: dict[str, Any]) -> Any:
        self.busy_since = time.monotonic()
        try:
            return request.infer(inputs, share_inputs=True)
        finally:
            self.busy_since = None

    def reset(self) -> None:
        self._lm.reset_state()
        self.past_len = 0
        self.history = []

    def trim(self, keep: int) -> None:
        """Keep the first ``keep`` positions of the KV state (as GenAI's trim_kv_cache)."""
        if keep <= 0:
            self.reset()
            return
        if keep < self.past_len:
            for state in self._lm.query_state():
                data = state.state.data
                axis = _sequence_axis(data.shape, self.past_len)
                index = [slice(None)] * data.ndim
                index[axis] = slice(0, keep)
                state.state = ov.Tensor(np.ascontiguousarray(data[tuple(index)]))
            self.past_len = keep
        del self.history[keep:]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        out = self._infer(self._embed, {"input": ids.reshape(1, -1).astype(np.int64)})
        return np.array(out[0][0])  # copy: the request's buffer is reused

    def step(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
             deepstack: np.ndarray) -> np.ndarray:
        """Run the LM on ``embeds`` [S,H] after ``past_len`` cached positions.

        positions [3,S]; visual_mask [S] bool; deepstack [k,Nvis,H] for the masked rows
        (zeros [k,1,H] when there are none). Returns the last position's logits [V].
        """
        seq = embeds.shape[0]
        inputs = {
            "inputs_embeds": embeds.reshape(1, seq, -1),
            "attention_mask": np.ones((1, self.past_len + seq), dtype=np.int64),
            "position_ids": positions.reshape(3, 1, seq).astype(np.int64),
            "visual_pos_masks": visual_mask.reshape(1, seq),
            "deepstack_visual_embeds": deepstack,
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
        out = self._infer(self._lm, inputs)
        self.past_len += seq
        logits = out[0]
        return np.array(logits[0, -1], dtype=np.float32)

    def no_deepstack(self) -> np.ndarray:
        return np.zeros((self._models.deepstack_layers, 1, self._models.hidden_size), np.float32)

    def vision_patches(self, patches: np.ndarray) -> np.ndarray:
        return np.array(self._infer(self._vision, {"hidden_states": patches})[0])

    def vision_positions(self, corner_ids: np.ndarray) -> np.ndarray:
        return np.array(self._infer(self._vision_pos, {"input": corner_ids})[0])

    def vision_merge(self, hidden: np.ndarray, mask: np.ndarray,
                     rotary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = self._infer(self._merger, {"hidden_states": hidden, "attention_mask": mask,
                                         "rotary_pos_emb": rotary})
        return np.array(out[0]), np.array(out[1])


class SlotPool:
    """Infer requests with their KV states, shared as a prefix cache.

    ``acquire(keys)`` hands out the free slot whose history shares the longest prefix
    with ``keys`` (the least recently used one when none does, so that recent caches
    survive); retained KV states beyond ``budget_tokens`` are evicted LRU.
    """

    def __init__(self, models: CompiledModels, size: int, budget_tokens: int | None = None
                 ) -> None:
        self.slots = [Slot(models) for _ in range(size)]
        self.budget_tokens = budget_tokens
        self._free: list[Slot] = list(self.slots)  # least recently used first
        self._cond = threading.Condition()

    @contextmanager
    def acquire(self, keys: list[tuple[int, bytes | None]] | None = None) -> Iterator[Slot]:
        with self._cond:
            while not self._free:
                self._cond.wait()
            best = max(range(len(self._free)),
                       key=lambda i: (common_prefix(self._free[i].history, keys or []), -i))
            slot = self._free.pop(best)
        try:
            yield slot
        except BaseException:
            slot.reset()  # a failed run leaves the KV state unknown
            raise
        finally:
            with self._cond:
                self._free.append(slot)
                self._evict()
                self._cond.notify()

    def _evict(self) -> None:
        """Drop the least recently used idle KV states beyond the budget (lock held)."""
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
