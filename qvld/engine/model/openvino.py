"""The OpenVINO backend, the only module that imports openvino: read, adapt, compile,
and run the submodels.

Every submodel is compiled once. A ``Slot`` bundles one infer request per submodel so
that one generation owns everything it runs on; its KV cache is the language model
request's internal state. The ``backend.SlotPool`` holds ``engine.infer_requests`` of them.

The compiled-model cache is verified before OpenVINO sees it (``model_cache``).
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._offline_transformations import paged_attention_transformation

from qvld.config import EngineConfig, ModelConfig
from qvld.engine.model.compiled_cache import cache_key, open_model_cache
from qvld.engine.model.interface import SlotBase
from qvld.engine.model.model_dir import LANGUAGE_SUBMODELS, SUBMODELS, ModelSpec
from qvld.engine.model.slot_paged import BLOCK_ROWS, KvLayout, SlotPaged
from qvld.errors import ModelInvalid

log = logging.getLogger("qvld.engine")

# Ops that may sit between the lm_head MatMul and the logits output.
_PASS_THROUGH = {"Convert", "Multiply", "Divide", "Add", "Tanh"}


def _lm_head(model: ov.Model) -> Any:
    """The MatMul that makes the logits (through casts and soft-capping), or None."""
    node = model.output("logits").get_node().input_value(0).get_node()
    while node.get_type_name() in _PASS_THROUGH:
        node = node.input_value(0).get_node()
    return node if node.get_type_name() == "MatMul" else None


def slice_logits_to_last_position(model: ov.Model) -> bool:
    """Make the LM compute logits for the last position only.

    The export computes logits for every prompt position ([B,S,V]); a slice of the
    hidden states before the lm_head MatMul turns that into [B,1,V]. Returns whether
    the graph was changed (False if it has no recognisable lm_head).
    """
    node = _lm_head(model)
    if node is None:
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


def gather_last_token_per_sequence(model: ov.Model) -> bool:
    """The paged-attention form of ``slice_logits_to_last_position``.

    After ``paged_attention_transformation`` the tokens of every sequence in a step are
    packed on one axis ([tokens,1,H] before the lm_head); this gathers the last row of
    each (``subsequence_begins[1:] - 1``), so logits come out [sequences,1,V].
    """
    node = _lm_head(model)
    if node is None:
        return False
    hidden = node.input_value(0)
    begins = {p.get_friendly_name(): p for p in model.get_parameters()}.get("subsequence_begins")
    if begins is None or hidden.get_partial_shape().rank.get_length() != 3:
        return False
    ends = ops.slice(begins, np.array([1], dtype=np.int32),
                     np.array([np.iinfo(np.int32).max], dtype=np.int32),
                     np.array([1], dtype=np.int32), np.array([0], dtype=np.int32))
    last = ops.subtract(ends, np.array([1], dtype=np.int32))
    node.input(0).replace_source_output(ops.gather(hidden, last, np.int32(0)).output(0))
    model.validate_nodes_and_infer_types()
    return True


def patch_embedding_as_matmul(model: ov.Model) -> bool:
    """Run the vision patch embedding as the MatMul it is.

    The export flattens each patch to a row and reshapes it back into [N,3,2,16,16] for a
    Conv3d whose kernel and stride are the whole patch: one output per patch, i.e.
    rows @ weights.reshape(C,-1).T. OpenVINO's CPU plugin runs that convolution ~40x
    slower than the MatMul (114 ms vs 2.8 ms for a 448x448 image on the full-size model).
    Returns whether the graph was changed (False if it has another shape).
    """
    convs = [n for n in model.get_ordered_ops() if n.get_type_name() == "Convolution"]
    if len(convs) != 1:
        return False
    conv = convs[0]
    source = conv.input_value(0).get_node()
    kernel = conv.get_input_partial_shape(1)
    consumers = list(conv.output(0).get_target_inputs())
    if (source.get_type_name() != "Reshape" or len(consumers) != 1 or kernel.is_dynamic
            or source.input_value(0).get_node().get_type_name() != "Parameter"):
        return False
    flatten = consumers[0].get_node()
    kernel_dims = [int(d) for d in kernel.to_shape()][2:]
    patch_dims = source.get_output_partial_shape(0)
    if (flatten.get_type_name() != "Reshape" or patch_dims.rank.get_length() != len(kernel_dims) + 2
            or flatten.get_output_partial_shape(0).rank.get_length() != 2
            or [int(d) for d in conv.get_strides()] != kernel_dims
            or any(d.is_dynamic or int(d.get_length()) != k
                   for d, k in zip(list(patch_dims)[2:], kernel_dims, strict=True))):
        return False
    rows = source.input_value(0)
    weights = ops.reshape(conv.input_value(1), np.array([0, -1], dtype=np.int64), True)
    flatten.output(0).replace(ops.matmul(rows, weights, False, True).output(0))
    model.validate_nodes_and_infer_types()
    return True


@dataclass(frozen=True)
class WeightLayout:
    """How a model's compressed weights are stored (NNCF's weight compression)."""

    bits: int  # 8 or 4
    symmetric: bool  # signed storage, no zero points
    group_size: int  # weights per scale; -1: one scale per output channel

    def __str__(self) -> str:
        groups = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"int{self.bits} {'sym' if self.symmetric else 'asym'} {groups}"


_COMPRESSED = {"i8": (8, True), "u8": (8, False), "i4": (4, True), "u4": (4, False)}


def weight_layout(model: ov.Model) -> WeightLayout | None:
    """The layout holding most weight bytes, or None for a float model.

    Compressed weights are integer constants decompressed by Convert (-> Subtract for
    zero points) -> Multiply by scales; grouped ones are stored [out, in/group, group].
    """
    counts: Counter[WeightLayout] = Counter()
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Constant":
            continue
        kind = _COMPRESSED.get(node.get_output_element_type(0).get_type_name())
        shape = [int(d) for d in node.get_output_shape(0)]
        if kind is None or len(shape) not in (2, 3) or min(shape) < 2:
            continue  # zero points and scalars are not weights
        if not any(t.get_node().get_type_name() == "Convert"
                   for t in node.output(0).get_target_inputs()):
            continue
        bits, symmetric = kind
        group = shape[-1] if len(shape) == 3 else -1
        counts[WeightLayout(bits, symmetric, group)] += int(np.prod(shape)) * bits // 8
    return counts.most_common(1)[0][0] if counts else None


def auto_precision(layout: WeightLayout | None, language: bool) -> str | None:
    """f32 for a language model with compressed weights, else the runtime's default.

    OpenVINO's CPU plugin quantises activations dynamically (int8 dot products against
    int8/int4 weights) only at f32; at bf16 (its default where the CPU has AMX or
    AVX512-BF16) every step decompresses the weights to bf16 instead. Measured here on the
    full-size model (BENCHMARKS.md): int8 decode 160 -> 100 ms a token, int4 100 -> 65,
    prefill about the same. The vision models keep bf16, where AMX makes them faster.
    """
    return "f32" if language and layout is not None else None


def auto_dynamic_quantization(layout: WeightLayout | None) -> int | None:
    """The activation quantisation group for these weights: the weights' own group for
    grouped ones (a mismatch was slower), 128 for per-channel ones (32, the runtime's
    default, made prefill 1.5x slower for the same decode speed), None for float weights."""
    if layout is None:
        return None
    return layout.group_size if layout.group_size > 0 else 128


def compile_properties(model_cfg: ModelConfig, engine_cfg: EngineConfig,
                       layout: WeightLayout | None = None, language: bool = False
                       ) -> dict[str, Any]:
    props: dict[str, Any] = {
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": str(engine_cfg.streams),
    }
    if engine_cfg.threads != "auto":
        props["INFERENCE_NUM_THREADS"] = int(engine_cfg.threads)
    precision = (auto_precision(layout, language) if model_cfg.precision == "auto"
                 else model_cfg.precision)
    if precision is not None:
        props["INFERENCE_PRECISION_HINT"] = precision
    if model_cfg.kv_cache_precision != "auto":
        props["KV_CACHE_PRECISION"] = model_cfg.kv_cache_precision
    dq = model_cfg.dynamic_quantization
    group = (auto_dynamic_quantization(layout) if dq == "auto"
             else 0 if dq == "off" else int(dq))
    if group is not None:
        props["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = group
    return props


class CompiledModels:
    """The compiled submodels of one model directory."""

    def __init__(self, spec: ModelSpec, model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 vision: bool = True, kv_cache_precision: str | None = None) -> None:
        """``vision`` False: the vision submodels are not compiled (another runtime encodes
        images); ``kv_cache_precision`` overrides model.kv_cache_precision's auto."""
        core = ov.Core()
        wanted = [sub for sub in SUBMODELS if vision or sub in LANGUAGE_SUBMODELS]
        models = {sub: _read(core, spec, sub) for sub in wanted}
        self.weight_layout = weight_layout(models["language_model"])
        # Continuous batching runs the language model in its paged-attention form: the
        # KV cache in block tensors the engine hands every step, not in request state.
        self.paged = engine_cfg.continuous_batching
        if self.paged:
            paged_attention_transformation(models["language_model"])
            self.logits_sliced = gather_last_token_per_sequence(models["language_model"])
        else:
            self.logits_sliced = slice_logits_to_last_position(models["language_model"])
        self.patch_matmul = vision and patch_embedding_as_matmul(models["vision_embeddings_model"])
        # Each submodel gets the activation quantisation its own weights call for.
        props = {sub: compile_properties(
                     model_cfg, engine_cfg,
                     self.weight_layout if sub == "language_model" else weight_layout(model),
                     language=sub == "language_model")
                 for sub, model in models.items()}
        if kv_cache_precision is not None and model_cfg.kv_cache_precision == "auto":
            props["language_model"]["KV_CACHE_PRECISION"] = kv_cache_precision
        # The cache is keyed by the properties too: the cache dir is set before compiling.
        runtime = f"openvino {ov.__version__}"
        key = "" if model_cfg.cache_dir is None else cache_key(
            spec, runtime + (" paged" if self.paged else ""),
                                                               model_cfg.device, props)
        blobs: list[Path] = []
        with open_model_cache(model_cfg.cache_dir, key, runtime) as cache:
            if cache is not None:
                core.set_property({"CACHE_DIR": str(cache.path)})
            compiled = {sub: _compile(core, models[sub], sub, model_cfg.device, props[sub])
                        for sub in wanted}
            if cache is not None:
                cache.seal()
                blobs = cache.blobs()
        self.language = compiled["language_model"]
        self.embeddings = compiled["text_embeddings_model"]
        self.vision = compiled.get("vision_embeddings_model")
        self.vision_pos = compiled.get("vision_embeddings_pos_model")
        self.vision_merger = compiled.get("vision_embeddings_merger_model")
        # Where the weights are mapped from: the IR's .bin files, or the compiled blobs
        # when the model cache served them.
        self.weight_files = {str(spec.ir(sub).with_suffix(".bin").resolve()) for sub in wanted}
        self.weight_files |= {str(p.resolve()) for p in blobs}
        self.hidden_size = spec.hidden_size
        self.deepstack_layers = spec.vision.deepstack_layers
        kv_type = self.language.get_property("KV_CACHE_PRECISION")
        kv_bytes = max(1, (kv_type.bitwidth + 7) // 8) if hasattr(kv_type, "bitwidth") else 2
        # keys and values, every layer, every KV head.
        self.kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_bytes
        self.kv_layout = KvLayout(2 * spec.num_layers, spec.num_kv_heads, spec.head_dim)
        # Without paged attention the step loop runs the stateful model through
        # ``SlotPaged``, whose f32 blocks are what engine.kv_cache_mb holds.
        self.kv_block_size = BLOCK_ROWS
        if not self.paged:
            self.kv_bytes_per_token = self.kv_layout.bytes_per_token
        else:  # what the plugin's cache layout takes (u8 adds scales per row)
            self.kv_block_size = PagedLanguage.block_size_of(self.language)
            self.kv_bytes_per_token = -(-PagedLanguage.bytes_per_block(self.language)
                                        // self.kv_block_size)
        self.runtime = "openvino"
        # Another runtime's models that encode images and prefill prompts (``backend``
        # attaches them: model.prompt_backend), or None.
        self.prompt: Any = None
        self.runtime_version = str(ov.__version__).split("-")[0]  # 2026.4.1-<build> -> 2026.4.1
        self.runtime_properties = {
            key: _text(self.language.get_property(key))
            for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "INFERENCE_NUM_THREADS",
                        "DYNAMIC_QUANTIZATION_GROUP_SIZE")
        }
        self.runtime_properties["WEIGHTS"] = str(self.weight_layout or "float")

    def new_slot(self) -> Slot:
        return Slot(self)

    def new_paged(self, num_blocks: int, slots: int) -> PagedLanguage | SlotPaged:
        """The step loop's model: the paged-attention language model, or (compiled
        stateful) ``slots`` slots behind a block store."""
        if not self.paged:
            return SlotPaged(self.new_slot, slots, num_blocks, self.kv_layout)
        return PagedLanguage(self, num_blocks)


def _read(core: ov.Core, spec: ModelSpec, submodel: str) -> ov.Model:
    path = spec.ir(submodel)
    try:
        return core.read_model(path)
    except RuntimeError as exc:
        raise ModelInvalid(f"{path.name} (or its .bin) cannot be read: "
                           f"{_last_line(exc)}") from exc


def _compile(core: ov.Core, model: ov.Model, submodel: str, device: str,
             props: dict[str, Any]) -> ov.CompiledModel:
    try:
        return core.compile_model(model, device, props)
    except RuntimeError as exc:
        raise ModelInvalid(f"openvino_{submodel}.xml cannot be compiled: "
                           f"{_last_line(exc)}") from exc


def _sequence_axis(shape: Any, length: int) -> int:
    """The KV state's sequence axis: [batch, kv_heads, seq, head_dim] in these exports."""
    if len(shape) == 4 and shape[2] == length:
        return 2
    matches = [i for i, n in enumerate(shape) if n == length]
    if not matches:
        raise RuntimeError(f"no axis of length {length} in a KV state of shape {shape}")
    return matches[-1]


def _state_key(name: str) -> tuple[int, int]:
    """(layer, 0 for keys / 1 for values) of a KV state ("past_key_values.3.key...")."""
    match = re.match(r"past_key_values\.(\d+)\.(key|value)", name)
    if match is None:
        raise ModelInvalid(f"the language model's state {name!r} is not a KV cache")
    return int(match[1]), match[2] == "value"


def _last_line(exc: BaseException) -> str:
    """OpenVINO's messages span lines; the last non-empty one says what is wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _text(value: Any) -> str:
    """OpenVINO property values as short text (element types as 'bf16', 'u8', ...)."""
    return str(value.to_string()) if hasattr(value, "to_string") else str(value)


class Slot(SlotBase):
    """One generation's infer requests; the LM request holds a KV cache (stateful)."""

    def __init__(self, models: CompiledModels) -> None:
        super().__init__(models.deepstack_layers, models.hidden_size)
        self._models = models
        # With paged attention the language model runs in the engine's step loop.
        self._lm = None if models.paged else models.language.create_infer_request()
        self._embed = models.embeddings.create_infer_request()
        # None when another runtime encodes the images (``hybrid``).
        self._vision = models.vision and models.vision.create_infer_request()
        self._vision_pos = models.vision_pos and models.vision_pos.create_infer_request()
        self._merger = models.vision_merger and models.vision_merger.create_infer_request()
        self._beam_idx = np.zeros(1, dtype=np.int32)  # allocated once, passed every step
        self._state_order: list[int] | None = None
        if models.prompt is not None:
            self.prompt_slot = models.prompt.new_slot()

    def _infer(self, request: Any, inputs: dict[str, Any]) -> Any:
        with self._running():
            return request.infer(inputs, share_inputs=True)

    def _drop_cache(self) -> None:
        if self._lm is not None:
            self._lm.reset_state()

    def _truncate_cache(self, keep: int) -> None:
        """The first ``keep`` positions of every KV state (as GenAI's trim_kv_cache)."""
        assert self._lm is not None
        for state in self._lm.query_state():
            data = state.state.data
            axis = _sequence_axis(data.shape, self.past_len)
            index = [slice(None)] * data.ndim
            index[axis] = slice(0, keep)
            state.state = ov.Tensor(np.ascontiguousarray(data[tuple(index)]))

    def _states(self) -> list[Any]:
        """The KV states in past_key_values order: key then value of each layer."""
        assert self._lm is not None
        if self._state_order is None:
            names = [state.name for state in self._lm.query_state()]
            self._state_order = sorted(range(len(names)), key=lambda i: _state_key(names[i]))
        states = self._lm.query_state()
        return [states[i] for i in self._state_order]

    def load_rows(self, kv: list[np.ndarray]) -> None:
        for state, rows in zip(self._states(), kv, strict=True):
            state.state = ov.Tensor(np.ascontiguousarray(rows, dtype=np.float32))
        self.past_len = kv[0].shape[2]

    def rows_from(self, start: int) -> list[np.ndarray]:
        # [batch, kv heads, rows, head dim], as the runtime converts it out (f32).
        return [state.state.data[:, :, start:] for state in self._states()]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        out = self._infer(self._embed, {"input": ids.reshape(1, -1).astype(np.int64)})
        return np.array(out[0][0])  # copy: the request's buffer is reused

    def step(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
             deepstack: np.ndarray) -> np.ndarray:
        """Run the LM on ``embeds`` [S,H] after ``past_len`` cached positions.

        positions [3,S]; visual_mask [S] bool; deepstack [k,Nvis,H] for the masked rows
        (zeros [k,1,H] when there are none). Returns the last position's logits [V], in a
        buffer the next step overwrites (copy it to keep it).
        """
        seq = embeds.shape[0]
        inputs = {
            "inputs_embeds": embeds.reshape(1, seq, -1),
            "attention_mask": self._attention_mask(self.past_len + seq),
            "position_ids": np.asarray(positions, dtype=np.int64).reshape(3, 1, seq),
            "visual_pos_masks": visual_mask.reshape(1, seq),
            "deepstack_visual_embeds": deepstack,
            "beam_idx": self._beam_idx,
        }
        assert self._lm is not None, "paged models step in the engine's batch loop"
        out = self._infer(self._lm, inputs)
        self.past_len += seq
        return self._keep_logits(out[0][0, -1])

    def vision_patches(self, patches: np.ndarray) -> np.ndarray:
        if self.prompt_slot is not None:
            with self._running():  # the watchdog watches this slot
                return self.prompt_slot.vision_patches(patches)
        return np.array(self._infer(self._vision, {"hidden_states": patches})[0])

    def vision_positions(self, corner_ids: np.ndarray) -> np.ndarray:
        if self.prompt_slot is not None:
            with self._running():  # the watchdog watches this slot
                return self.prompt_slot.vision_positions(corner_ids)
        return np.array(self._infer(self._vision_pos, {"input": corner_ids})[0])

    def vision_merge(self, hidden: np.ndarray, mask: np.ndarray,
                     rotary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.prompt_slot is not None:
            with self._running():  # the watchdog watches this slot
                return self.prompt_slot.vision_merge(hidden, mask, rotary)
        out = self._infer(self._merger, {"hidden_states": hidden, "attention_mask": mask,
                                         "rotary_pos_emb": rotary})
        return np.array(out[0]), np.array(out[1])


class PagedLanguage:
    """The language model in paged-attention form, with its KV block tensors.

    One infer request runs every step of every sequence; the caches are allocated once
    ([blocks, kv heads, block size, head dim] per layer, as the plugin lays them out:
    read from the compiled model, never assumed), untouched pages costing nothing until
    written. Only the engine's step thread calls ``step``.
    """

    def __init__(self, models: CompiledModels, num_blocks: int) -> None:
        self.block_size = self.block_size_of(models.language)
        self.num_blocks = num_blocks
        self.batches_decoding = True
        self._request = models.language.create_infer_request()
        self._embed = models.embeddings.create_infer_request()
        self.busy_since: float | None = None
        self.cache_bytes = 0
        self._caches: dict[str, ov.Tensor] = {}
        for port in _cache_inputs(models.language):
            dims = [num_blocks, *(int(d.get_length()) for d in list(port.get_partial_shape())[1:])]
            tensor = ov.Tensor(port.get_element_type(), dims)
            self.cache_bytes += tensor.byte_size
            self._request.set_tensor(port.get_any_name(), tensor)
            self._caches[port.get_any_name()] = tensor
        # Rows can be read and written from outside (a prefill another runtime computed)
        # only where each is a plain [heads, head_dim] vector: f32 or f16, not u8 with
        # the plugin's scales appended.
        self.rows_accessible = all(t.element_type in (ov.Type.f32, ov.Type.f16)
                                   for t in self._caches.values())
        self._no_deepstack = np.zeros((models.deepstack_layers, 1, models.hidden_size),
                                      np.float32)
        self._max_context = np.zeros((), np.int32)

    @staticmethod
    def block_size_of(compiled: ov.CompiledModel) -> int:
        """Rows per block: the value cache's third axis ([blocks, heads, rows, head_dim]
        + scales). Not the key cache's: at u8 the CPU plugin quantises keys per channel
        and appends the scales to that axis ([?, heads, 32 + 8, head_dim])."""
        return int(compiled.input("value_cache.0").get_partial_shape()[2].get_length())

    @staticmethod
    def bytes_per_block(compiled: ov.CompiledModel) -> int:
        total = 0
        for port in _cache_inputs(compiled):
            dims = [int(d.get_length()) for d in list(port.get_partial_shape())[1:]]
            bits = port.get_element_type().bitwidth
            total += int(np.prod(dims)) * bits // 8
        return total

    def _layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(key, value) cache arrays [blocks, heads, block rows, head_dim] per layer."""
        count = len(self._caches) // 2
        return [(self._caches[f"key_cache.{i}"].data, self._caches[f"value_cache.{i}"].data)
                for i in range(count)]

    def _spans(self, blocks: list[int], start: int, count: int
               ) -> list[tuple[int, int, int, int]]:
        """(block, first row in it, rows, offset into the span) covering rows
        [start, start + count) of a sequence whose block table is ``blocks``."""
        size, spans, row = self.block_size, [], start
        while row < start + count:
            n = min(size - row % size, start + count - row)
            spans.append((blocks[row // size], row % size, n, row - start))
            row += n
        return spans

    def read_rows(self, blocks: list[int], count: int) -> list[np.ndarray]:
        """The first ``count`` KV rows of a sequence: f32 [1, heads, count, head_dim],
        key then value of each layer (the order of ONNX's past_key_values inputs)."""
        out = []
        for key, value in self._layers():
            for cache in (key, value):
                rows = np.empty((1, cache.shape[1], count, cache.shape[3]), np.float32)
                for block, lo, n, at in self._spans(blocks, 0, count):
                    rows[0, :, at:at + n] = cache[block, :, lo:lo + n]
                out.append(rows)
        return out

    def write_rows(self, blocks: list[int], start: int, kv: list[np.ndarray]) -> None:
        """Store rows [start, start + n) of a sequence from ``kv`` (as ``read_rows``
        returns them, [1, heads, n, head_dim] each). Only blocks of this sequence past
        its shared prefix are written: the step thread never reads them meanwhile."""
        count = kv[0].shape[2]
        caches = [cache for pair in self._layers() for cache in pair]
        spans = self._spans(blocks, start, count)
        for cache, rows in zip(caches, kv, strict=True):
            rows = rows[0].astype(cache.dtype)  # converted once, then copied per block
            for block, lo, n, at in spans:
                cache[block, :, lo:lo + n] = rows[:, at:at + n]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Token ids [S] -> embeddings [S,H] (a copy: the request's buffer is reused)."""
        out = self._embed.infer({"input": ids.reshape(1, -1).astype(np.int64)},
                                share_inputs=True)
        return np.array(out[0][0])

    def no_deepstack(self) -> np.ndarray:
        return self._no_deepstack

    def step(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
             deepstack: np.ndarray, past_lens: np.ndarray, begins: np.ndarray,
             block_begins: np.ndarray, block_indices: np.ndarray) -> np.ndarray:
        """One pass over the packed rows of every scheduled sequence: ``embeds`` [T,H],
        ``positions`` [3,T], ``visual_mask`` [T], ``deepstack`` [k,Nvis,H] (the masked
        rows', in order), ``past_lens`` [S] rows each already has, ``begins`` [S+1] where
        each one's rows start in the pack, its blocks
        ``block_indices[block_begins[i]:block_begins[i+1]]``. Returns the logits of each
        sequence's last row [S,V] (the runtime's buffer: read before the next step)."""
        self._max_context[()] = int((past_lens + np.diff(begins)).max())
        inputs = {
            "inputs_embeds": embeds,
            "position_ids": positions,
            "visual_pos_masks": visual_mask.reshape(1, -1),
            "deepstack_visual_embeds": deepstack,
            "max_context_len": self._max_context,
            "past_lens": past_lens,
            "subsequence_begins": begins,
            "block_indices_begins": block_begins,
            "block_indices": block_indices,
        }
        self.busy_since = time.monotonic()
        try:
            out = self._request.infer(inputs, share_inputs=True)
        finally:
            self.busy_since = None
        return np.asarray(out[0])[:, 0]


def _cache_inputs(compiled: ov.CompiledModel | ov.Model) -> list[Any]:
    return [port for port in compiled.inputs
            if port.get_any_name().startswith(("key_cache.", "value_cache."))]
