"""`qvlctl model export-onnx`: a Qwen3-VL checkpoint as five ONNX graphs for ONNX Runtime.

The submodels and their tensors (names are the contract with ``qvld.engine.model.onnxruntime``):

======================  ==========================================  ===========================
file                    inputs                                      outputs
======================  ==========================================  ===========================
onnx_text_embeddings_   input [B,S] int64                           inputs_embeds [B,S,H]
model.onnx
onnx_vision_embeddings  hidden_states [N, C*T*P*P]                  patch_embeds [N,Hv]
_model.onnx
onnx_vision_embeddings  input [4,N] int64 (bilinear corner rows)    pos_embeds [4,N,Hv]
_pos_model.onnx
onnx_vision_embeddings  hidden_states [N,Hv],                       image_embeds [N/m²,H],
_merger_model.onnx      rotary_pos_emb [N,hd/2]                     deepstack [k,N/m²,H]
onnx_language_model     inputs_embeds [B,S,H], position_ids         logits [B,1,V],
.onnx                   [3,B,S], visual_pos_masks [B,S] bool,       present.L.key/value
                        deepstack_visual_embeds [k,Nvis,H],         [B,kv,C,hd] (the same
                        seqlens_k [B] int32, total_sequence_length  buffers as the pasts)
                        int32, past_key_values.L.key/value
                        [B,kv,C,hd]
======================  ==========================================  ===========================

The language model's KV cache is written in place (ONNX Runtime's GroupQueryAttention):
each layer's past and present are one buffer of C rows per sequence, bound to both
(``past_present_share_buffer``). Sequence b's rows are [0, seqlens_k[b] + 1), the last S
of them the ones this call adds; rows past that are never read, so sequences of
different lengths share a batch without padding or a mask, and cutting a cache back is
only a smaller ``seqlens_k``. ``total_sequence_length`` is the largest of them.

The same host-side inputs as the OpenVINO export (the engine's image, position and
prompt code is shared), except that the language model carries its KV cache as explicit
inputs and outputs instead of internal state, and computes logits for the last position
only, and that the vision merger takes no attention mask: the engine encodes one image
per call, where the mask is all zeros (adding it cost 5 % of the encoder's time on the
full-size model; graphs exported before take it, and are still fed one). The graphs
are traced from forward functions written here over the checkpoint's own modules (norms,
projections, MLPs, rotary tables), with plain ops where transformers dispatches on
run-time values (attention over ``cu_seqlens``, boolean-mask deepstack writes, cache
objects), so every axis that varies stays dynamic. The vision blocks' rotary embedding
and attention, and the decoder's attention, are ONNX Runtime's fused contrib ops
(``com.microsoft`` RotaryEmbedding, MultiHeadAttention and GroupQueryAttention: the
graphs are for ONNX Runtime, the runtime that reads them).

Weights: ``fp32`` as exported, or ``int8``: onnxruntime's dynamic quantisation of every
MatMul/Gemm weight (per output channel, signed), activations quantised per call,
computed a tensor at a time by ``onnx_int8`` (the same model, byte for byte).

Memory: each part (text embeddings, vision, language model) is traced in a process of
its own, holding only its own weights, as fp32 tensors in files mapped shared (the
kernel writes them back and drops them under pressure), the language model's
projections stored transposed (so constant folding copies none of them). The full-size
int8 export runs inside an 8 GiB memory cgroup (``bench/peak_memory.py``; BENCHMARKS.md,
"Memory: building the ONNX layout").

Needs the ``convert`` extra (torch, transformers, onnx, onnxruntime).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from qvld.engine.model.model_dir import (
    INT8_PER_ROW,
    KV_IN_PLACE,
    SUBMODELS,
    ir_path,
    onnx_path,
)
from qvld.modeltools.convert import SIDE_FILES, add_beside_ir, write_model

# The ONNX opset: 20 has Gelu, so the vision MLP's tanh GELU is one op instead of nine
# element-wise ones (14 % of the full-size encoder's time at opset 17, whose export ONNX
# Runtime's GELU fusion does not match); 17+ has LayerNormalization.
OPSET = 20
# ONNX Runtime's contrib ops (fused rotary embedding and attention) and the graphs using them.
CONTRIB_OPSET = {"com.microsoft": 1}
CONTRIB_USERS = ("vision_embeddings_merger_model", "language_model")


def _say(text: str) -> None:
    print(f"qvlctl model: {text}", file=sys.stderr, flush=True)


def _modules() -> Any:
    """The torch modules, defined on first use: torch is imported only by this command."""
    import torch
    from torch import nn
    from torch.jit._trace import TracerWarning
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen

    class TableLookup(nn.Module):
        """Rows of an embedding table: the text embeddings, the vision position table."""

        def __init__(self, table: Any) -> None:
            super().__init__()
            self.table = table

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            rows: torch.Tensor = self.table(ids)
            return rows

    class PatchEmbedding(nn.Module):
        """The Conv3d whose kernel is the whole patch, as the MatMul it is."""

        def __init__(self, model: Any) -> None:
            super().__init__()
            proj = model.model.visual.patch_embed.proj
            self.weight = nn.Parameter(proj.weight.detach().reshape(proj.weight.shape[0], -1))
            self.bias = nn.Parameter(proj.bias.detach())

        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(rows, self.weight, self.bias)

    class Rotary(torch.autograd.Function):
        """Rotary position embedding of one image's queries or keys [1, N, heads*hd]
        (halves rotated, as transformers' vision rotary does), exported as ONNX Runtime's
        fused RotaryEmbedding: the split, negation, concatenation and products it replaces
        cost 9 % of the encoder."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, heads: int) -> torch.Tensor:
            rows = x.reshape(x.shape[0], x.shape[1], heads, -1)
            first, second = rows.chunk(2, dim=-1)
            c, s = cos[positions][:, :, None, :], sin[positions][:, :, None, :]
            out = torch.cat((first * c - second * s, second * c + first * s), dim=-1)
            return out.reshape(x.shape)

        @staticmethod
        def symbolic(g: Any, x: Any, positions: Any, cos: Any, sin: Any, heads: int) -> Any:
            out = g.op("com.microsoft::RotaryEmbedding", x, positions, cos, sin,
                       interleaved_i=0, num_heads_i=heads)
            out.setType(x.type())  # the input's shape (the tracer cannot infer it)
            return out

    class Attention(torch.autograd.Function):
        """Every patch of one image attending to every other ([1, N, heads*hd] each),
        exported as ONNX Runtime's MultiHeadAttention, whose CPU kernel never holds a
        whole [heads, N, N] score matrix (flash attention: 0.73x of the MatMul, Softmax,
        MatMul graph on a 784-patch image)."""

        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                    scale: float) -> torch.Tensor:
            b, n = q.shape[0], q.shape[1]
            q, k, v = (t.reshape(b, n, heads, -1).transpose(1, 2) for t in (q, k, v))
            weights = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * scale, dim=-1)
            return torch.matmul(weights, v).transpose(1, 2).reshape(b, n, -1)

        @staticmethod
        def symbolic(g: Any, q: Any, k: Any, v: Any, heads: int, scale: float) -> Any:
            out = g.op("com.microsoft::MultiHeadAttention", q, k, v, num_heads_i=heads,
                       scale_f=scale)
            out.setType(q.type())
            return out

    class CachedAttention(torch.autograd.Function):
        """A decoder layer's attention over its KV cache, exported as ONNX Runtime's
        GroupQueryAttention, which writes the new rows into the cache in place: the
        cache input and output are one buffer [B, kv, capacity, hd], and each
        sequence's rows are [0, seqlens_k[b] + 1) of it, the last S of them new. A
        graph that concatenated the past with the new rows copied the whole f32 cache
        every token (1.4x GenAI's time per token at 2 000 rows of context)."""

        @staticmethod
        def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    past_k: torch.Tensor, past_v: torch.Tensor, seqlens_k: torch.Tensor,
                    total: torch.Tensor, heads: int, kv_heads: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            # What the op computes (the trace only needs the shapes; this is the meaning,
            # whose int() of a traced tensor the tracer would warn about).
            warnings.filterwarnings("ignore", category=TracerWarning)
            batch, seq = q.shape[0], q.shape[1]
            present_k, present_v = past_k.clone(), past_v.clone()
            out = torch.empty_like(q)
            for b in range(batch):
                end = int(seqlens_k[b]) + 1
                start = end - seq
                present_k[b, :, start:end] = k[b].reshape(seq, kv_heads, -1).transpose(0, 1)
                present_v[b, :, start:end] = v[b].reshape(seq, kv_heads, -1).transpose(0, 1)
                keys = present_k[b, :, :end].repeat_interleave(heads // kv_heads, dim=0)
                values = present_v[b, :, :end].repeat_interleave(heads // kv_heads, dim=0)
                rows = q[b].reshape(seq, heads, -1).transpose(0, 1)
                scores = torch.matmul(rows, keys.transpose(1, 2)) * scale
                causal = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
                scores = scores.masked_fill(~causal, float("-inf"))
                out[b] = torch.matmul(torch.softmax(scores, dim=-1), values) \
                    .transpose(0, 1).reshape(seq, -1)
            return out, present_k, present_v

        @staticmethod
        def symbolic(g: Any, q: Any, k: Any, v: Any, past_k: Any, past_v: Any,
                     seqlens_k: Any, total: Any, heads: int, kv_heads: int,
                     scale: float) -> Any:
            out, present_k, present_v = g.op(
                "com.microsoft::GroupQueryAttention", q, k, v, past_k, past_v, seqlens_k,
                total, num_heads_i=heads, kv_num_heads_i=kv_heads, scale_f=scale, outputs=3)
            out.setType(q.type())
            present_k.setType(past_k.type())
            present_v.setType(past_v.type())
            return out, present_k, present_v

    # Function.apply is untyped: typed once here.
    rotate = cast(Callable[..., torch.Tensor], Rotary.apply)
    attend = cast(Callable[..., torch.Tensor], Attention.apply)
    attend_cached = cast(Callable[..., tuple[torch.Tensor, ...]], CachedAttention.apply)

    class VisionMerger(nn.Module):
        """Vision blocks over one image, the merger, and the deepstack mergers."""

        def __init__(self, model: Any) -> None:
            super().__init__()
            self.visual = model.model.visual
            self.deepstack_at = {layer: i for i, layer in
                                 enumerate(self.visual.deepstack_visual_indexes)}

        def forward(self, hidden: torch.Tensor,
                    rotary: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rotary.cos(), rotary.sin()  # [N, hd/2]: both halves rotate alike
            n = hidden.shape[0]
            positions = torch.arange(n).unsqueeze(0)  # row i has rotary row i
            deepstack = []
            for layer, block in enumerate(self.visual.blocks):
                attn = block.attn
                qkv = attn.qkv(block.norm1(hidden)).reshape(1, n, 3, -1)
                q, k, v = qkv.unbind(2)  # [1, N, heads*hd] each
                q = rotate(q, positions, cos, sin, attn.num_heads)
                k = rotate(k, positions, cos, sin, attn.num_heads)
                # One image: every patch attends to every other (no mask to add).
                out = attend(q, k, v, attn.num_heads, attn.scaling).reshape(n, -1)
                hidden = hidden + attn.proj(out)
                hidden = hidden + block.mlp(block.norm2(hidden))
                if layer in self.deepstack_at:
                    deepstack.append(self.visual.deepstack_merger_list[
                        self.deepstack_at[layer]](hidden))
            return self.visual.merger(hidden), torch.stack(deepstack)

    class LanguageModel(nn.Module):
        """The decoder over its KV cache (explicit tensors, written in place), logits
        for the last row."""

        def __init__(self, model: Any) -> None:
            super().__init__()
            self.text = model.model.language_model
            self.lm_head = model.lm_head
            self.deepstack_layers = len(model.config.vision_config.deepstack_visual_indexes)
            self.heads = model.config.text_config.num_attention_heads
            self.kv_heads = model.config.text_config.num_key_value_heads

        def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor,
                    visual_mask: torch.Tensor, deepstack: torch.Tensor,
                    seqlens_k: torch.Tensor, total: torch.Tensor,
                    *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
            batch, seq = embeds.shape[0], embeds.shape[1]
            cos, sin = self.text.rotary_emb(embeds, position_ids)
            # Row -> its image row: an add where the mask is set (deepstack), + 0 elsewhere.
            image_row = (torch.cumsum(visual_mask.long(), dim=-1) - 1).clamp(min=0)
            keep = visual_mask[..., None]
            hidden = embeds
            present: list[torch.Tensor] = []
            for index, layer in enumerate(self.text.layers):
                attn = layer.self_attn
                x = layer.input_layernorm(hidden)
                shape = (batch, seq, -1, attn.head_dim)
                q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
                k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
                v = attn.v_proj(x).view(shape)
                q, k = qwen.apply_rotary_pos_emb(q, k, cos, sin)
                out, key, value = attend_cached(
                    q.transpose(1, 2).reshape(batch, seq, -1),
                    k.transpose(1, 2).reshape(batch, seq, -1), v.reshape(batch, seq, -1),
                    past[2 * index], past[2 * index + 1], seqlens_k, total, self.heads,
                    self.kv_heads, attn.scaling)
                present += [key, value]
                hidden = hidden + attn.o_proj(out)
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
                if index < self.deepstack_layers:
                    rows = deepstack[index][image_row]  # [B,S,H]
                    hidden = hidden + torch.where(keep, rows, torch.zeros_like(rows))
            logits = self.lm_head(self.text.norm(hidden[:, -1:, :]))
            return (logits, *present)

    return TableLookup, PatchEmbedding, VisionMerger, LanguageModel


# What each part of the export traces, in a process of its own (see export_fp32).
PARTS = {"text": ("text_embeddings_model",),
         "vision": ("vision_embeddings_model", "vision_embeddings_pos_model",
                    "vision_embeddings_merger_model"),
         "language": ("language_model",)}


def export_fp32(src: Path, dst: Path) -> None:
    """Trace the five submodels of the checkpoint in ``src`` into ``dst`` at fp32.

    Each part (text embeddings, vision, language model) is traced in a fresh process
    that keeps only the weights it needs and makes only those fp32, so the peak is the
    largest part, not the whole model twice (``bench/peak_memory.py``): the full-size
    language model is 6.9 GB of fp32 weights, the whole checkpoint 8.5 GB.
    """
    import multiprocessing

    for part in PARTS:
        child = multiprocessing.get_context("spawn").Process(target=export_part,
                                                             args=(src, dst, part))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"exporting the {part} part failed (exit {child.exitcode})")


class FileBacked:
    """fp32 tensors whose pages live in files (mapped shared, the files unlinked at
    once): the kernel can write them back and drop them under memory pressure, where
    anonymous memory would have to fit. The exporter reads each weight once, in order,
    to write it out; holding the full-size language model's 6.9 GB of fp32 weights as
    anonymous memory is what made the export need more than a small server has."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.count = 0

    def copy(self, tensor: Any) -> Any:
        """``tensor`` (any layout, any float dtype) as a contiguous fp32 file-backed copy."""
        import torch

        self.count += 1
        path = self.directory / f"{self.count}.f32"
        out = torch.from_file(str(path), shared=True, size=max(tensor.numel(), 1),
                              dtype=torch.float32)[:tensor.numel()].view(tensor.shape)
        path.unlink()  # the mapping keeps the file until the tensor is freed
        out.copy_(tensor)
        return out


def _keep_only(model: Any, part: str, store: FileBacked) -> None:
    """Drop the weights ``part`` does not trace, and make the rest fp32 in files, one
    tensor at a time (the checkpoint's own dtype was loaded: the upcast is exact)."""
    import gc

    import torch

    inner = model.model
    if part != "vision":
        inner.visual = None
    if part == "vision":
        inner.language_model, model.lm_head = None, None
    if part == "text":
        inner.language_model.layers = torch.nn.ModuleList()
        model.lm_head = None
    if part == "language":
        inner.language_model.embed_tokens = None  # the graph takes embeddings
    gc.collect()
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(store.copy(param.detach()),
                                                     requires_grad=False))
            del param
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point() and buffer.dtype != torch.float32:
                module.register_buffer(name, buffer.float())
    gc.collect()


def _transposed_linears(root: Any, store: FileBacked) -> None:
    """Each Linear under ``root`` as a MatMul by its weight stored transposed: traced
    as it is, where a Linear over 3-D rows is traced as MatMul(x, Transpose(W)) and
    constant folding then makes a transposed copy of every weight (6.9 GB more for the
    full-size language model). The graph is the same (MatMul by W^T, then + bias)."""
    import torch
    from torch import nn

    class TransposedLinear(nn.Module):
        def __init__(self, linear: nn.Linear) -> None:
            super().__init__()
            self.weight_t = nn.Parameter(store.copy(linear.weight.detach().t()),
                                         requires_grad=False)
            self.bias = linear.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.matmul(x, self.weight_t)
            return out if self.bias is None else out + self.bias

    # By name, not a list of modules: a list would keep every replaced Linear (and its
    # weight) alive until the end, two copies of every weight at once.
    names = [name for name, module in root.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = root.get_submodule(parent) if parent else root
        setattr(owner, attr, TransposedLinear(getattr(owner, attr)))


def export_part(src: Path, dst: Path, part: str) -> None:
    """Trace one part's graphs (``PARTS``) of the checkpoint in ``src`` into ``dst``."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    table_lookup, patch_embedding, vision_merger, language_model = _modules()
    model: Any = Qwen3VLForConditionalGeneration.from_pretrained(src, dtype="auto")
    model.eval()
    text, vision = model.config.text_config, model.config.vision_config
    weights = tempfile.TemporaryDirectory(dir=dst, prefix=f".weights-{part}-")
    store = FileBacked(Path(weights.name))
    _keep_only(model, part, store)
    hidden, vis_hidden = text.hidden_size, vision.hidden_size
    merge = vision.spatial_merge_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    layers, kv_heads = text.num_hidden_layers, text.num_key_value_heads
    head_dim = text.head_dim or hidden // text.num_attention_heads
    k = len(vision.deepstack_visual_indexes)
    n = 4 * merge * merge  # patches of the sample image: a 4x4-merge-block grid
    vis_head = vis_hidden // vision.num_heads

    def export(module: Any, args: tuple[Any, ...], name: str, inputs: list[str],
               outputs: list[str], axes: dict[str, dict[int, str]]) -> None:
        # Traced into a directory of its own (large graphs come out as one file per
        # tensor), then saved into ``dst`` as one graph file (+ one data file if large).
        with tempfile.TemporaryDirectory(dir=dst) as scratch, torch.no_grad():
            traced = Path(scratch) / "model.onnx"
            torch.onnx.export(module.eval(), args, str(traced), input_names=inputs,
                              output_names=outputs, dynamic_axes=axes, opset_version=OPSET,
                              custom_opsets=CONTRIB_OPSET if name in CONTRIB_USERS else None,
                              dynamo=False, do_constant_folding=True)
            save_graph(traced, onnx_path(dst, name), "fp32")

    if part == "text":
        export(table_lookup(model.model.language_model.embed_tokens),
               (torch.zeros(1, 3, dtype=torch.long),), "text_embeddings_model", ["input"],
               ["inputs_embeds"],
               {"input": {0: "batch", 1: "seq"}, "inputs_embeds": {0: "batch", 1: "seq"}})
        return
    if part == "vision":
        export(patch_embedding(model), (torch.zeros(n, patch),), "vision_embeddings_model",
               ["hidden_states"], ["patch_embeds"],
               {"hidden_states": {0: "patches"}, "patch_embeds": {0: "patches"}})
        export(table_lookup(model.model.visual.pos_embed),
               (torch.zeros(4, n, dtype=torch.long),),
               "vision_embeddings_pos_model", ["input"], ["pos_embeds"],
               {"input": {1: "patches"}, "pos_embeds": {1: "patches"}})
        export(vision_merger(model),
               (torch.zeros(n, vis_hidden), torch.zeros(n, vis_head // 2)),
               "vision_embeddings_merger_model",
               ["hidden_states", "rotary_pos_emb"], ["image_embeds", "deepstack"],
               {"hidden_states": {0: "patches"}, "rotary_pos_emb": {0: "patches"},
                "image_embeds": {0: "tokens"}, "deepstack": {1: "tokens"}})
        return
    _transposed_linears(model, store)  # the decoder's projections and lm_head
    seq, past_len, capacity = 3, 2, 8
    past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present_names = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    axes: dict[str, dict[int, str]] = {
        "inputs_embeds": {0: "batch", 1: "seq"},
        "position_ids": {1: "batch", 2: "seq"},
        "visual_pos_masks": {0: "batch", 1: "seq"},
        "deepstack_visual_embeds": {1: "visual_rows"},
        "seqlens_k": {0: "batch"},
        "logits": {0: "batch"},
        **{name: {0: "batch", 2: "capacity"} for name in past_names + present_names},
    }
    visual = torch.tensor([[False, True, False]])
    export(language_model(model),
           (torch.zeros(1, seq, hidden), torch.arange(seq).expand(3, 1, seq), visual,
            torch.zeros(k, 1, hidden), torch.tensor([past_len + seq - 1], dtype=torch.int32),
            torch.tensor(past_len + seq, dtype=torch.int32),
            *[torch.zeros(1, kv_heads, capacity, head_dim) for _ in past_names]),
           "language_model",
           ["inputs_embeds", "position_ids", "visual_pos_masks", "deepstack_visual_embeds",
            "seqlens_k", "total_sequence_length", *past_names], ["logits", *present_names],
           axes)


def save_graph(src: Path, dst: Path, weights: str) -> None:
    """Save the graph at ``src`` as ``dst``, its external tensors (if any) gathered into
    one ``dst.data`` file, page-aligned, one tensor in memory at a time: a full-size
    graph is larger than protobuf's 2 GiB and than what fits beside the model in RAM.
    The metadata entry ``qvld.weights`` says what the weights are (the engine reports it);
    ``qvld.kv_cache`` that the language model writes its cache in place, and
    ``qvld.int8_activations`` that an int8 graph quantises its activations per row
    (graphs without them are an older export the engine asks to be redone).
    """
    import onnx

    proto = onnx.load(str(src), load_external_data=False)
    del proto.metadata_props[:]
    props = {"qvld.weights": weights}
    if any(i.name == "seqlens_k" for i in proto.graph.input):  # the language model
        props["qvld.kv_cache"] = KV_IN_PLACE
    if weights == "int8":  # onnx_int8 quantised it
        props["qvld.int8_activations"] = INT8_PER_ROW
    onnx.helper.set_model_props(proto, props)
    external = [t for t in proto.graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        data = dst.with_name(dst.name + ".data")
        with data.open("wb") as out:
            for tensor in external:
                info = {entry.key: entry.value for entry in tensor.external_data}
                with (src.parent / info["location"]).open("rb") as source:
                    source.seek(int(info.get("offset", 0)))
                    blob = source.read(int(info["length"]) if "length" in info else -1)
                out.write(b"\0" * (-out.tell() % 4096))  # aligned: the runtime maps it
                offset = out.tell()
                out.write(blob)
                del tensor.external_data[:]
                for key, value in (("location", data.name), ("offset", str(offset)),
                                   ("length", str(len(blob)))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, value
    onnx.save_model(proto, str(dst))


def quantize_int8(directory: Path) -> None:
    """Replace each graph by its int8 form (``onnx_int8``: every MatMul and Gemm weight
    in int8 as onnxruntime's dynamic quantisation makes it, computed a tensor at a time,
    and activations quantised per row).

    Signed weights per output channel (the layout that decodes fastest in OpenVINO too);
    the embedding tables (Gather) stay fp32: they are read one row at a time. Weights use
    7 of their 8 bits (``reduce_range``): on CPUs without VNNI (AVX2 only), ORT multiplies
    u8 activations by s8 weights with a saturating 16-bit pairwise add, and full-range
    weights overflow it (first-token logits at cosine 0.97 against fp32 on the tiny model
    here, 0.99+ with 7 bits); a model is exported once and served anywhere.
    """
    from qvld.modeltools.onnx_int8 import quantize_graph

    for submodel in SUBMODELS:
        path = onnx_path(directory, submodel)
        out = path.with_name(path.stem + ".int8.onnx")
        quantize_graph(path, out)
        for stale in (path, path.with_name(path.name + ".data")):
            stale.unlink(missing_ok=True)
        save_graph(out, path, "int8")
        for done in (out, out.with_name(out.name + ".data")):
            done.unlink(missing_ok=True)


def export_directory(source: Path, out: Path, weights: str) -> None:
    """The graphs (quantised for int8) and the files the engine reads beside them."""
    export_fp32(source, out)
    if weights == "int8":
        _say("quantising the MatMul weights to int8")
        # In a fresh process: the heap torch kept after tracing would come on top of it.
        import multiprocessing

        child = multiprocessing.get_context("spawn").Process(target=quantize_int8, args=(out,))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"quantisation failed (exit {child.exitcode})")
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)


def export_onnx(src: str, dst: Path, weights: str) -> int:
    """``qvlctl model export-onnx``: export, quantise, check it answers, move into place;
    into a directory holding the checkpoint's OpenVINO IR, beside it (prompt backend)."""
    what = f"to ONNX with {weights} weights"

    def run(source: Path, out: Path) -> None:
        export_directory(source, out, weights)

    if ir_path(dst, "language_model").is_file():
        return add_beside_ir(src, dst, what, run)
    return write_model(src, dst, what, run, backend="onnxruntime")
