"""How far lower precision moves the logits: top-1 agreement and KL divergence.

    python bench/logit_agreement.py precision MODEL_DIR [--tokens 24]
    python bench/logit_agreement.py quantisation HF_DIR OV_DIR... [--tokens 24]

Teacher forcing: the reference's own greedy continuation of each prompt is fed to every
candidate, and the logits each computes for every next token are compared with the
reference's at the same position — the top-1 token agreement and the mean KL(ref || cand)
in nats, over 4 prompts (two with a scene image, two text only).

``precision``: the reference is qvld's engine at f32 compute and f32 KV cache (which
equals transformers fp32 token for token); candidates are the other precision settings.
``quantisation``: the reference is transformers at bf16 on the unquantised checkpoint
(the model the quantised exports came from); candidates are those exports run by qvld's
engine at its default precision.
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
from qvld.engine.generate import never, prefill

PROMPTS: list[tuple[int | None, str]] = [
    (1, "Describe this image."), (2, "What is in the picture? Answer briefly."),
    (None, "Write a short poem about the sea."), (None, "List three uses of a brick."),
]


def messages(image_seed: int | None, text: str, size: int) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if image_seed is not None:
        content.insert(0, {"type": "image", "image": scene(size, image_seed)})
    return [{"role": "user", "content": content}]


def engine_for(model: Path, precision: str = "auto", kv: str = "auto") -> Engine:
    return Engine(Config(model=ModelConfig(path=model, precision=precision,  # type: ignore[arg-type]
                                           kv_cache_precision=kv),  # type: ignore[arg-type]
                         engine=EngineConfig(infer_requests=1, image_cache_mb=0, kv_cache_mb=0)))


def forced_logits(engine: Engine, request: GenerateRequest, continuation: list[int]
                  ) -> tuple[list[int], np.ndarray]:
    """The prompt's ids and the logits [len(continuation), V] the engine computes for each
    continuation token given the prompt and the continuation before it."""
    prepared = engine.prepare(request)
    ids = list(prepared.ids)
    full = ids + continuation[:-1]
    with engine.pool.acquire() as slot:
        slot.reset()
        prompt = engine.assemble(slot, full, prepared.images, prepared.image_starts)
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
    reference = engine_for(model, "f32", "f32")
    cases = []
    for seed, text in PROMPTS:
        request = GenerateRequest(messages=messages(seed, text, size), max_tokens=tokens,
                                  temperature=0.0, ignore_eos=True)
        continuation = reference.generate(request).token_ids
        cases.append((request, continuation, forced_logits(reference, request, continuation)[1]))
    del reference
    print(f"{model.name}: reference f32 compute, f32 KV cache\n{HEADER}")
    # f32/f32 again first: a control that must give 100 % and KL 0.
    for compute, kv in (("f32", "f32"), ("bf16", "f32"), ("f32", "u8"), ("bf16", "u8"),
                        ("bf16", "f16")):
        engine = engine_for(model, compute, kv)
        report(f"{compute} compute, {kv} KV", [
            (ref, forced_logits(engine, request, cont)[1]) for request, cont, ref in cases])


def quantisation(hf_dir: Path, models: list[Path], tokens: int, size: int) -> None:
    import torch
    from PIL import Image
    from systems import build_processor
    from transformers import Qwen3VLForConditionalGeneration

    torch.set_num_threads(2)
    hf = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    processor = build_processor(hf_dir)
    tokenizer_engine = engine_for(models[0])
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
        cases.append((request, continuation, logits))
    del hf, tokenizer_engine
    print(f"reference: transformers bf16 on {hf_dir.name}; candidates at qvld's default "
          f"precision\n{HEADER}")
    for model in models:
        engine = engine_for(model)
        report(f"{model.name} ({engine.models.runtime_properties['WEIGHTS']})", [
            (ref, forced_logits(engine, request, cont)[1]) for request, cont, ref in cases])
        del engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["precision", "quantisation"])
    parser.add_argument("dirs", type=Path, nargs="+")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--size", type=int, default=448)
    args = parser.parse_args(argv)
    if args.mode == "precision":
        for model in args.dirs:
            precision(model, args.tokens, args.size)
    else:
        if len(args.dirs) < 2:
            parser.error("quantisation needs HF_DIR and at least one OV_DIR")
        quantisation(args.dirs[0], args.dirs[1:], args.tokens, args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
