"""The ONNX Runtime backend, the only module that imports onnxruntime.

One InferenceSession per submodel (``onnx_*.onnx`` from ``qvlctl model export-onnx``),
shared by every slot: a session's ``run`` is thread-safe. A ``Slot`` owns its KV cache:
one f32 buffer per layer's keys and values, ``[sequences, kv heads, capacity, head dim]``,
bound (I/O binding) as both the ``past_key_values.*`` input and the ``present.*``
output, which the graph's GroupQueryAttention writes the new rows into in place. A step
copies no cache row; the buffers grow ``PRESENT_ROWS`` rows at a time.

Sessions run with every graph optimisation (ORT_ENABLE_ALL), sequential execution,
``engine.threads`` intra-op threads (the pinned cores, from tuning), one inter-op thread,
and threads that spin between ops only where no other runtime shares the cores
(``engine.spin_wait``). The CPU arena grows by what is requested rather than doubling,
and the memory pattern planner is off: shapes change every call (prompt length, KV
length), so a planned pattern never repeats.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import onnxruntime as ort

from qvld.config import EngineConfig, ModelConfig
from qvld.engine.model.interface import SlotBase
from qvld.engine.model.model_dir import SUBMODELS, ModelSpec, onnx_outdated
from qvld.engine.model.slot_paged import BLOCK_ROWS, KvLayout, SlotPaged
from qvld.errors import ModelInvalid


def session_options(engine_cfg: EngineConfig, spin: bool = True) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    threads = engine_cfg.threads
    options.intra_op_num_threads = (len(os.sched_getaffinity(0)) if threads == "auto"
                                    else int(threads))
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = True
    options.enable_mem_pattern = False
    options.add_session_config_entry("session.use_env_allocators", "1")
    # Spinning threads answer the next op sooner, and take the cores from whatever else
    # runs (another runtime's threads: engine.spin_wait).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.log_severity_level = 3  # errors only: warnings about unused initialisers
    return options


_arena_lock = threading.Lock()
_arena_registered = False


def register_shared_arena() -> None:
    """One CPU arena for every session in the process (once), grown by what is asked
    (kSameAsRequested) instead of doubling: sessions opt in with use_env_allocators."""
    global _arena_registered
    with _arena_lock:
        if _arena_registered:
            return
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                   ort.OrtMemType.DEFAULT)
        # max_mem 0 (no limit), extend strategy 1 (same as requested), default chunks.
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, 1, -1, -1))
        _arena_registered = True


# Rows a cache buffer grows by (a decoding sequence reallocates once in this many steps).
PRESENT_ROWS = 256

# Run option: the arena frees its unused regions when the run ends (prompts and images,
# whose activations are large and of every size; not decode steps, whose are small).
_SHRINK = ort.RunOptions()
_SHRINK.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")


class SessionModels:
    """The five InferenceSessions of one model directory."""

    def __init__(self, spec: ModelSpec, model_cfg: ModelConfig, engine_cfg: EngineConfig,
                 submodels: tuple[str, ...] = SUBMODELS, beside: bool = False) -> None:
        """``submodels``: the graphs to load (for a prompt backend: the vision models and
        the language model, not the embeddings another runtime already has); ``beside``:
        another runtime runs in this process on the same cores (a prompt backend)."""
        if model_cfg.precision == "bf16" or model_cfg.kv_cache_precision not in ("auto", "f32"):
            raise ModelInvalid("the onnxruntime backend computes at f32 with an f32 KV cache: "
                               "leave model.precision and model.kv_cache_precision at auto "
                               "(or f32)")
        register_shared_arena()
        spin = not beside if engine_cfg.spin_wait == "auto" else bool(engine_cfg.spin_wait)
        options = session_options(engine_cfg, spin)
        providers = ["CPUExecutionProvider"]

        def load(submodel: str) -> ort.InferenceSession:
            path = spec.onnx(submodel)
            try:
                session = ort.InferenceSession(str(path), options, providers=providers)
            except Exception as exc:  # onnxruntime raises its own exception types
                raise ModelInvalid(f"{path.name} cannot be loaded: {_first_line(exc)}") from exc
            return session

        self.sessions = {submodel: load(submodel) for submodel in submodels}
        lm = self.sessions["language_model"]
        self.past_names = [i.name for i in lm.get_inputs() if i.name.startswith("past_key_values.")]
        self.present_names = [o.name for o in lm.get_outputs() if o.name.startswith("present.")]
        outdated = onnx_outdated(spec.path)
        if outdated or "seqlens_k" not in {i.name for i in lm.get_inputs()}:
            raise ModelInvalid(outdated or "onnx_language_model.onnx takes no seqlens_k: "
                               "export it again with `qvlctl model export-onnx`")
        if len(self.past_names) != 2 * spec.num_layers or \
                len(self.present_names) != len(self.past_names):
            raise ModelInvalid(f"onnx_language_model.onnx has {len(self.past_names)} past "
                               f"key/value inputs; {2 * spec.num_layers} expected")
        self.hidden_size = spec.hidden_size
        self.deepstack_layers = spec.vision.deepstack_layers
        # A large graph's weights (its .data file) may be mapped; the MatMul weights are
        # prepacked into memory of ORT's own, so the mapped pages can be dropped.
        self.weight_files = {str(p.resolve()) for sub in submodels
                             for p in (spec.onnx(sub), spec.onnx(sub).with_name(
                                 spec.onnx(sub).name + ".data")) if p.exists()}
        self.runtime = "onnxruntime"
        self.prompt = None
        # One sequence per inference: the step loop runs it through ``SlotPaged``, whose
        # f32 blocks are what engine.kv_cache_mb holds.
        self.paged = False
        self.kv_layout = KvLayout(2 * spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.kv_bytes_per_token = self.kv_layout.bytes_per_token  # keys and values, f32
        self.kv_block_size = BLOCK_ROWS
        self.runtime_version = str(ort.__version__)
        self.runtime_properties = {
            "BACKEND": f"onnxruntime {ort.__version__}",
            "INFERENCE_PRECISION_HINT": "f32",
            "KV_CACHE_PRECISION": "f32",
            "INFERENCE_NUM_THREADS": str(options.intra_op_num_threads),
            "SPIN_WAIT": "on" if spin else "off",
            # Written by the exporter into the graph's metadata.
            "WEIGHTS": lm.get_modelmeta().custom_metadata_map.get("qvld.weights", "unknown"),
        }

    def new_slot(self) -> Slot:
        return Slot(self)

    def new_paged(self, num_blocks: int, slots: int) -> SlotPaged:
        """The step loop's model: ``slots`` slots behind a block store, and the decode
        lane (a row's logits do not depend on the other rows of its step: the int8
        graphs quantise activations per row)."""
        return SlotPaged(self.new_slot, slots, num_blocks, self.kv_layout,
                         lane=self.new_slot())


def _view(value: ort.OrtValue) -> np.ndarray:
    """An f32 CPU OrtValue as a numpy view of its memory (valid while it lives)."""
    shape = tuple(value.shape())
    view: np.ndarray = np.asarray(_Memory(value.data_ptr(), shape))
    return view


class _Memory:
    """An f32 buffer at an address, as numpy's array interface describes one."""

    def __init__(self, address: int, shape: tuple[int, ...]) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": shape,
                                    "typestr": "<f4", "version": 3}


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _capacity(rows: int) -> int:
    return max(1, -(-rows // PRESENT_ROWS)) * PRESENT_ROWS


class Slot(SlotBase):
    """One generation's KV cache (``BatchSlot``: or several side by side, the decode
    lane's) and its step's I/O binding.

    The cache is ``self._caches`` (keys then values of each layer), each ``[sequences,
    kv heads, capacity, head dim]``; sequence b's rows are ``[0, self._lengths[b])``,
    the rest unused. One sequence (``step``, ``load_rows``) keeps ``past_len`` and
    ``_lengths[0]`` equal."""

    def __init__(self, models: SessionModels) -> None:
        super().__init__(models.deepstack_layers, models.hidden_size)
        self._models = models
        self._lm = models.sessions["language_model"]
        # Absent ones (a prompt backend's) are never called.
        self._embed = models.sessions.get("text_embeddings_model")
        self._vision = models.sessions.get("vision_embeddings_model")
        self._vision_pos = models.sessions.get("vision_embeddings_pos_model")
        self._merger = models.sessions.get("vision_embeddings_merger_model")
        self._merger_takes_mask = self._merger is not None and "attention_mask" in {
            i.name for i in self._merger.get_inputs()}
        self._binding = self._lm.io_binding()
        self._layout = models.kv_layout
        self._caches: list[np.ndarray] = []
        self._lengths = np.zeros(1, np.int32)
        self._logits_value: ort.OrtValue | None = None
        self.reset()

    def _run(self, session: ort.InferenceSession, inputs: dict[str, np.ndarray]) -> list[Any]:
        with self._running():
            return list(session.run(None, inputs, _SHRINK))

    def _allocate(self, sequences: int, capacity: int) -> list[np.ndarray]:
        layout = self._layout
        return [np.empty((sequences, layout.heads, capacity, layout.head_dim), np.float32)
                for _ in range(layout.caches)]

    def _make_room(self, rows: int) -> None:
        """Grow the buffers to hold ``rows`` rows per sequence, keeping those held."""
        sequences = len(self._lengths)
        if self._caches and self._caches[0].shape[2] >= rows \
                and self._caches[0].shape[0] == sequences:
            return
        held = int(self._lengths.max()) if self._caches else 0
        grown = self._allocate(sequences, _capacity(rows))
        for new, old in zip(grown, self._caches, strict=False):
            new[:, :, :held] = old[:, :, :held]
        self._caches = grown

    def _drop_cache(self) -> None:
        self._caches = []  # a reset slot holds no memory for a cache
        self._lengths = np.zeros(1, np.int32)

    def _truncate_cache(self, keep: int) -> None:
        self._lengths[0] = keep  # the rows after it are never read, and are overwritten

    def load_rows(self, kv: list[np.ndarray]) -> None:
        rows = kv[0].shape[2]
        self._caches = self._allocate(1, _capacity(rows + 1))
        for cache, array in zip(self._caches, kv, strict=True):
            cache[:, :, :rows] = array
        self._lengths = np.array([rows], np.int32)
        self.past_len = rows

    def rows_from(self, start: int) -> list[np.ndarray]:
        # Views of the cache's own memory, valid until the next step, trim or reset.
        return [cache[:, :, start:self.past_len] for cache in self._caches]

    def load_batch(self, lengths: list[int],
                   fill: Callable[[int, list[np.ndarray]], None]) -> None:
        """``BatchSlot.load_batch``: the cache becomes ``len(lengths)`` sequences."""
        self._caches = self._allocate(len(lengths), _capacity(max(lengths) + 1))
        for row, length in enumerate(lengths):
            fill(row, [cache[row, :, :length] for cache in self._caches])
        self._lengths = np.array(lengths, np.int32)
        self.past_len = 0  # per sequence: self._lengths

    def new_rows(self) -> list[np.ndarray]:
        """``BatchSlot.new_rows``: each sequence's last row, [B, kv heads, 1, head dim]."""
        sequences = np.arange(len(self._lengths))
        return [cache[sequences, :, self._lengths - 1][:, :, None] for cache in self._caches]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        out = self._run(self._embed, {"input": ids.reshape(1, -1).astype(np.int64)})
        return np.asarray(out[0][0])

    def step(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
             deepstack: np.ndarray) -> np.ndarray:
        seq = embeds.shape[0]
        self._lengths[0] = self.past_len
        logits = self._infer(embeds.reshape(1, seq, -1), positions.reshape(3, 1, seq),
                             visual_mask.reshape(1, seq), deepstack)
        self.past_len += seq
        return self._keep_logits(logits[0])

    def step_batch(self, embeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``BatchSlot.step_batch``: one new row for each sequence of the cache."""
        batch = embeds.shape[0]
        logits = self._infer(embeds, positions, np.zeros((batch, 1), bool), self._no_deepstack)
        return np.array(logits)

    def _infer(self, embeds: np.ndarray, positions: np.ndarray, visual_mask: np.ndarray,
               deepstack: np.ndarray) -> np.ndarray:
        """The language model: ``embeds`` [B,S,H] after each sequence's ``_lengths``
        rows, written into the cache in place -> the last rows' logits [B,V] (a view of
        the output, valid until the next call)."""
        seq = embeds.shape[1]
        self._make_room(int(self._lengths.max()) + seq)
        totals = self._lengths + seq
        binding = self._binding
        binding.clear_binding_inputs()
        binding.clear_binding_outputs()
        # Held in a local until the run returns: the binding points into them.
        inputs = {
            "inputs_embeds": np.ascontiguousarray(embeds, dtype=np.float32),
            "position_ids": np.ascontiguousarray(positions, dtype=np.int64),
            "visual_pos_masks": np.ascontiguousarray(visual_mask, dtype=bool),
            "deepstack_visual_embeds": np.ascontiguousarray(deepstack, dtype=np.float32),
            "seqlens_k": (totals - 1).astype(np.int32),
            "total_sequence_length": np.array(totals.max(), np.int32),
        }
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        # Each cache buffer is the past and the present: the graph writes the new rows
        # at each sequence's length and reads the rows before them where they are.
        names = zip(self._models.past_names, self._models.present_names, self._caches,
                    strict=True)
        for past, present, cache in names:
            binding.bind_cpu_input(past, cache)
            binding.bind_output(present, "cpu", 0, np.float32, list(cache.shape),
                                cache.ctypes.data)
        binding.bind_output("logits", "cpu")
        with self._running():
            # A prompt's activations are returned to the system after its run: prompts
            # of every length would otherwise each leave regions the arena keeps.
            self._lm.run_with_iobinding(binding, _SHRINK if seq > 1 else None)
        self._lengths = totals
        self._logits_value = binding.get_outputs()[-1]  # keeps the view below alive
        return _view(self._logits_value)[:, -1]

    def vision_patches(self, patches: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(patches, dtype=np.float32)
        return np.asarray(self._run(self._vision, {"hidden_states": rows})[0])

    def vision_positions(self, corner_ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(corner_ids, dtype=np.int64)
        return np.asarray(self._run(self._vision_pos, {"input": ids})[0])

    def vision_merge(self, hidden: np.ndarray, mask: np.ndarray,
                     rotary: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        feeds = {"hidden_states": np.ascontiguousarray(hidden, np.float32),
                 "rotary_pos_emb": rotary}
        if self._merger_takes_mask:  # exported before the merger dropped it (one image)
            feeds["attention_mask"] = mask
        out = self._run(self._merger, feeds)
        return np.asarray(out[0]), np.asarray(out[1])
