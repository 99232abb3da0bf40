"""How far lower precision moves the logits: top-1 agreement and KL divergence.

    python bench/logit_agreement.py precision MODEL_DIR [--tokens 24]
    python bench/logit_agreement.py quantisation HF_DIR OV_DIR... [--tokens 24]
    python bench/logit_agreement.py prompt-backend MODEL_DIR [--tokens 24]
    python bench/logit_agreement.py video-pruning MODEL_DIR [--tokens 24]

Teacher forcing: the reference's own greedy continuation of each prompt is fed to every
candidate, and the logits each computes for every next token are compared with the
reference's at the same position — the top-1 token agreement and the mean KL(ref || cand)
in nats, over 4 prompts (two with a scene image, two text only).

``precision``: the reference is qvld's engine at f32 compute, f32 KV cache and no dynamic
quantisation (which equals transformers fp32 token for token on the tiny models);
candidates are the other settings, qvld's default among them.
``quantisation``: the reference is transformers at bf16 (``--reference fp32``: at fp32)
on the unquantised checkpoint (the model the quantised exports came from); candidates
are those exports run by qvld's engine at its defaults and at bf16 without dynamic
quantisation.
``prompt-backend``: MODEL_DIR holds the IR and int8 ONNX graphs; the reference is qvld
all on OpenVINO at f32, f32 KV cache, no dynamic quantisation, batched; candidates are
the defaults with images and prompts on OpenVINO, and on ONNX Runtime (its int8 MatMuls,
then the rows copied into OpenVINO's f16 or f32 KV cache). Each runs the engine's own
path (``generate``), its sampler replaced by one that records the logits and returns the
forced token.
``video-pruning``: the reference is the engine at MODEL_DIR's defaults answering about
three 6 s 640x360 clips (a panning scene, bench/video.py's), unpruned; candidates are the
same with ``model.video_pruning`` at 0.25, 0.5 and 0.75 (the same continuation forced
after a prompt with fewer video rows), each with the video tokens it kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scenes import scene

from qvld.config import Config, EngineConfig, ModelConfig
from qvld.engine import Engine, GenerateRequest
from qvld.engine.decoding.generation import never, prefill

PROMPTS: list[tuple[int | None, str]] = [
    (1, "Describe this image."), (2, "What is in the picture? Answer briefly."),
    (None, "Write a short poem about the sea."), (None, "List three uses of a brick."),
]


def messages(image_seed: int | None, text: str, size: int) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image_seed is not None:
        content.insert(0, {"type": "image", "image": scene(size, image_seed)})
    return [{"role": "user", "content": content}]


# (label, compute precision, KV cache precision, dynamic quantisation)
Setting = tuple[str, str, str, str]
REFERENCE: Setting = ("f32 compute, f32 KV, no DQ", "f32", "f32", "off")
PRECISIONS: list[Setting] = [
    REFERENCE,  # again: a control that must give 100 % and KL 0
    ("qvld default (auto)", "auto", "auto", "auto"),
    ("bf16 compute, f32 KV", "bf16", "f32", "off"),
    ("f32 compute, u8 KV", "f32", "u8", "off"),
    ("f32 compute + DQ, f32 KV", "f32", "f32", "auto"),
    ("bf16 compute, u8 KV", "bf16", "u8", "off"),
]


def engine_for(model: Path, setting: Setting = ("", "auto", "auto", "auto")) -> Engine:
    from qvld.modeltools.convert import backend_of

    _, precision, kv, dq = setting
    return Engine(Config(model=ModelConfig(path=model, precision=precision,  # type: ignore[arg-type]
                                           kv_cache_precision=kv,  # type: ignore[arg-type]
                                           dynamic_quantization=dq,  # type: ignore[arg-type]
                                           backend=backend_of(model)),  # type: ignore[arg-type]
                         # forced_logits steps a slot of its own: no batch loop.
                         engine=EngineConfig(infer_requests=1, image_cache_mb=0, kv_cache_mb=0,
                                             continuous_batching=False)))


def forced_logits(engine: Engine, request: GenerateRequest, continuation: list[int]
                  ) -> tuple[list[int], np.ndarray]:
    """The prompt's ids and the logits [len(continuation), V] the engine computes for each
    continuation token given the prompt and the continuation before it."""
    prepared = engine.prepare(request)
    ids = list(prepared.ids)
    full = ids + continuation[:-1]
    with engine.pool.acquire() as slot:
        slot.reset()
        prompt = engine.prompts.assemble(slot, full, prepared.images, prepared.image_starts)
        assert prompt is not None
        n = len(ids)
        head = dataclasses.replace(prompt, ids=ids, positions=prompt.positions[:, :n],
                                   visual_mask=prompt.visual_mask[:n], keys=prompt.keys[:n])
        first = prefill(slot, head, 0, engine.config.engine.prefill_chunk, never)
        assert first is not None
        rows = [first.copy()]  # step() reuses its logits buffer
        for i in range(n, len(full)):
            embeds = slot.embed(np.asarray(full[i:i + 1]))
            rows.append(slot.step(embeds, prompt.positions[:, i:i + 1],
                                  np.zeros(1, dtype=bool), slot.no_deepstack()).copy())
        slot.reset()
    return ids, np.stack(rows)


def compare(ref: np.ndarray, cand: np.ndarray) -> tuple[float, float, float]:
    """top-1 agreement, mean KL(ref || cand) in nats, max |logit difference|."""
    ref = ref.astype(np.float64)
    cand = cand.astype(np.float64)
    top1 = float(np.mean(ref.argmax(-1) == cand.argmax(-1)))
    log_p = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    log_q = cand - np.logaddexp.reduce(cand, axis=-1, keepdims=True)
    kl = float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)))
    return top1, kl, float(np.abs(ref - cand).max())


def report(name: str, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    ref = np.concatenate([p[0] for p in pairs])
    cand = np.concatenate([p[1] for p in pairs])
    top1, kl, diff = compare(ref, cand)
    print(f"| {name} | {top1:.1%} | {kl:.2e} | {diff:.3f} | {len(ref)} |", flush=True)


HEADER = "| candidate | top-1 agreement | mean KL (nats) | max abs logit diff | positions |\n" \
         "|---|---|---|---|---|"


def precision(model: Path, tokens: int, size: int) -> None:
    reference = engine_for(model, REFERENCE)
    cases = []
    for seed, text in PROMPTS:
        request = GenerateRequest(messages=messages(seed, text, size), max_tokens=tokens,
                                  temperature=0.0, ignore_eos=True)
        continuation = reference.generate(request).token_ids
        cases.append((request, continuation, forced_logits(reference, request, continuation)[1]))
    del reference
    print(f"{model.name}: reference {REFERENCE[0]}\n{HEADER}")
    for setting in PRECISIONS:
        engine = engine_for(model, setting)
        props = engine.models.runtime_properties
        label = (f"{setting[0]} = {props['INFERENCE_PRECISION_HINT']}, KV "
                 f"{props['KV_CACHE_PRECISION']}, DQ {props['DYNAMIC_QUANTIZATION_GROUP_SIZE']}")
        report(label, [(ref, forced_logits(engine, request, cont)[1])
                       for request, cont, ref in cases])


def quantisation(hf_dir: Path, models: list[Path], tokens: int, size: int,
                 control: bool = False, reference: str = "bf16") -> None:
    import torch
    from PIL import Image
    from systems import build_processor
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(2)
    dtype = torch.float32 if reference == "fp32" else torch.bfloat16
    hf = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, dtype=dtype).eval()
    processor = build_processor(hf_dir)
    tokenizer_engine = engine_for(models[0])  # its tokeniser and template: the prompt ids
    cases = []
    for seed, text in PROMPTS:
        request = GenerateRequest(messages=messages(seed, text, size), max_tokens=tokens,
                                  temperature=0.0, ignore_eos=True)
        ids = list(tokenizer_engine.prepare(request).ids)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        images = None
        if seed is not None:
            content.insert(0, {"type": "image"})
            import io
            images = [Image.open(io.BytesIO(scene(size, seed))).convert("RGB")]
        rendered = processor.apply_chat_template([{"role": "user", "content": content}],
                                                 add_generation_prompt=True)
        inputs = processor(text=[rendered], images=images, return_tensors="pt")
        if inputs["input_ids"][0].tolist() != ids:
            raise SystemExit("transformers and qvld tokenise this prompt differently")
        with torch.inference_mode():
            out = hf.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False)
            continuation = out[0, len(ids):].tolist()
            full = out[:, :-1]
            extra = dict(inputs)
            extra["input_ids"] = full
            extra["attention_mask"] = torch.ones_like(full)
            logits = hf(**extra).logits[0, len(ids) - 1:].float().numpy()
        cases.append((request, continuation, logits, extra))
    print(f"reference: transformers {reference} on {hf_dir.name}\n{HEADER}", flush=True)
    if control and reference == "bf16":
        # The same checkpoint in transformers at fp32: how far precision alone moves
        # these logits (random weights give flat distributions: top-1 is fragile).
        hf = hf.float()
        with torch.inference_mode():
            report("transformers fp32 (control: no quantisation)", [
                (ref, hf(**extra).logits[0, len(extra["input_ids"][0]) - len(cont):].numpy())
                for _, cont, ref, extra in cases])
    del hf, tokenizer_engine
    from qvld.modeltools.convert import backend_of

    for model in models:
        settings: list[Setting] = [("qvld default", "auto", "auto", "auto")]
        if backend_of(model) == "openvino":  # ONNX Runtime computes at f32 only
            settings.append(("bf16, no DQ", "bf16", "auto", "off"))
        for setting in settings:
            engine = engine_for(model, setting)
            report(f"{model.name} ({engine.models.runtime_properties['WEIGHTS']}), "
                   f"{setting[0]}", [(ref, forced_logits(engine, request, cont)[1])
                                     for request, cont, ref, _ in cases])
            del engine


class ForcedSampler:
    """In place of the engine's Sampler: records each step's logits, returns the next
    token of a fixed continuation."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation
        self.rows: list[np.ndarray] = []

    def __call__(self, *_: Any) -> ForcedSampler:  # the engine constructs its Sampler
        return self

    def choose(self, logits: np.ndarray) -> int:
        self.rows.append(np.array(logits, dtype=np.float32))
        return self.continuation[len(self.rows) - 1]


def generated_logits(engine: Engine, request: GenerateRequest, continuation: list[int]
                     ) -> np.ndarray:
    """The logits [len(continuation), V] the engine's own generation path computes with
    ``continuation`` forced token by token."""
    from qvld.engine import engine as engine_module

    forced = ForcedSampler(continuation)
    original = engine_module.Sampler
    engine_module.Sampler = forced  # type: ignore[assignment,misc]
    try:
        engine.generate(dataclasses.replace(request, max_tokens=len(continuation)))
    finally:
        engine_module.Sampler = original  # type: ignore[misc]
    return np.stack(forced.rows)


def prompt_backend(model: Path, tokens: int, size: int) -> None:
    import gc

    def load(prompt: str, kv: str, precision: str = "auto", dq: str = "auto") -> Engine:
        return Engine(Config.model_validate({
            "model": {"path": str(model), "prompt_backend": prompt, "kv_cache_precision": kv,
                      "precision": precision, "dynamic_quantization": dq},
            "engine": {"infer_requests": 1, "image_cache_mb": 0, "kv_cache_mb": 0}}))

    reference = load("openvino", "f32", "f32", "off")
    cases = []
    for seed, text in PROMPTS:
        request = GenerateRequest(messages=messages(seed, text, size), max_tokens=tokens,
                                  temperature=0.0, ignore_eos=True)
        continuation = reference.generate(request).token_ids
        cases.append((request, continuation,
                      generated_logits(reference, request, continuation)))
    print(f"{model.name}: reference all OpenVINO, f32 compute, f32 KV, no DQ\n{HEADER}")
    for label, prompt, kv in (("defaults, prompts on OpenVINO", "openvino", "auto"),
                              ("defaults, prompts on ONNX Runtime int8", "onnxruntime", "auto"),
                              ("prompts on ONNX Runtime int8, KV f32", "onnxruntime", "f32")):
        engine = load(prompt, kv)
        props = engine.models.runtime_properties
        report(f"{label} (KV {props['KV_CACHE_PRECISION']}, DQ "
               f"{props['DYNAMIC_QUANTIZATION_GROUP_SIZE']})",
               [(ref, generated_logits(engine, request, cont)) for request, cont, ref in cases])
        del engine
        gc.collect()
    report("control: the reference again", [(ref, generated_logits(reference, request, cont))
                              for request, cont, ref in cases])


def video_pruning(model: Path, tokens: int) -> None:
    import gc

    from video import make_clip

    def load(rate: float) -> Engine:
        return Engine(Config.model_validate({
            "model": {"path": str(model), "video_pruning": rate},
            "engine": {"infer_requests": 1, "image_cache_mb": 0, "kv_cache_mb": 0}}))

    def ask(clip: bytes) -> GenerateRequest:
        return GenerateRequest(messages=[{"role": "user", "content": [
            {"type": "video", "video": clip}, {"type": "text", "text": "What happens?"}]}],
            max_tokens=tokens, temperature=0.0, ignore_eos=True)

    clips = [make_clip(6.0, 640, 360, seed) for seed in range(3)]
    reference = load(0.0)
    cases = []
    for clip in clips:
        result = reference.generate(ask(clip))
        cases.append((ask(clip), result.token_ids, result.usage.image_tokens,
                      generated_logits(reference, ask(clip), result.token_ids)))
    del reference
    gc.collect()
    print(f"{model.name}: reference unpruned, {sum(c[2] for c in cases)} video tokens in "
          f"{len(clips)} clips\n{HEADER}")
    for rate in (0.25, 0.5, 0.75):
        engine = load(rate)
        kept = sum(engine.generate(dataclasses.replace(request, max_tokens=1)
                                   ).usage.image_tokens for request, *_ in cases)
        report(f"video_pruning {rate} ({kept} video tokens)",
               [(ref, generated_logits(engine, request, cont)) for request, cont, _, ref in cases])
        del engine
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["precision", "quantisation", "prompt-backend",
                                         "video-pruning"])
    parser.add_argument("dirs", type=Path, nargs="+")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--control", action="store_true",
                        help="quantisation: also transformers fp32 against its bf16")
    parser.add_argument("--reference", choices=["bf16", "fp32"], default="bf16",
                        help="quantisation: transformers' precision for the reference")
    args = parser.parse_args(argv)
    if args.mode == "precision":
        for model in args.dirs:
            precision(model, args.tokens, args.size)
    elif args.mode == "prompt-backend":
        for model in args.dirs:
            prompt_backend(model, args.tokens, args.size)
    elif args.mode == "video-pruning":
        for model in args.dirs:
            video_pruning(model, args.tokens)
    else:
        if len(args.dirs) < 2:
            parser.error("quantisation needs HF_DIR and at least one OV_DIR")
        quantisation(args.dirs[0], args.dirs[1:], args.tokens, args.size, args.control,
                     args.reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
