"""Reference cases and what transformers (fp32, greedy) generates for them.

The cases are plain data (``TEXT_CASES``) so that the test suite can read them back from
``reference.json`` without torch. ``write_reference`` runs transformers on a saved
Hugging Face model directory and records, per case: the prompt ids, the generated ids
(including the eos id when generation ended on it, as ``generate`` returns them) and the
smallest top-1/top-2 logit margin seen, so a fragile (near-tie) case shows up at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LONG_TEXT = (
    "Systems that run on small CPU servers must answer fast, stay up and be observable. "
    "The daemon listens on a Unix socket, reads msgpack frames and streams tokens back. "
    "Red, green, blue, yellow, black and white are colours; circles, squares and lines. "
)

# Each case: name, messages (HF/OpenAI style), max_new_tokens.
TEXT_CASES: list[dict[str, Any]] = [
    {"name": "short", "messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 16},
    {
        "name": "question",
        "messages": [{"role": "user", "content": "What is in this picture? Describe the image."}],
        "max_new_tokens": 24,
    },
    {
        "name": "system",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": "How many people are in the photo?"},
        ],
        "max_new_tokens": 24,
    },
    {
        "name": "multi_turn",
        "messages": [
            {"role": "user", "content": "What colours are there?"},
            {"role": "assistant", "content": "Red, green and blue."},
            {"role": "user", "content": "And the shapes?"},
        ],
        "max_new_tokens": 24,
    },
    {
        "name": "non_ascii",
        "messages": [{"role": "user", "content": "Grüße! 你好，世界 🌍 — ¿Qué tal? Добрый день."}],
        "max_new_tokens": 24,
    },
    {
        "name": "parts",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Describe "},
                                         {"type": "text", "text": "the receipt."}]}
        ],
        "max_new_tokens": 20,
    },
    {
        "name": "long",
        "messages": [{"role": "user", "content": LONG_TEXT * 2 + "Summarise."}],
        "max_new_tokens": 24,
    },
    {
        "name": "longer_than_chunk",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": LONG_TEXT * 6 + "What is the daemon for?"},
        ],
        "max_new_tokens": 32,
    },
]


def generate_reference(model: Any, inputs: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    import torch

    with torch.no_grad():
        out = model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
        )
    prompt_len = inputs["input_ids"].shape[1]
    generated = out.sequences[0, prompt_len:].tolist()
    margins = []
    for scores in out.scores:
        top = torch.topk(scores[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return {
        "input_ids": inputs["input_ids"][0].tolist(),
        "token_ids": generated,
        "min_margin": min(margins),
    }


def write_reference(hf_dir: Path, out_dir: Path, preset: str) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = Qwen3VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    chat_template = (hf_dir / "chat_template.jinja").read_text()
    cases = []
    for case in TEXT_CASES:
        inputs = tokenizer.apply_chat_template(
            case["messages"],
            chat_template=chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        )
        ref = generate_reference(model, dict(inputs), case["max_new_tokens"])
        cases.append({**case, **ref})
    path = out_dir / "reference.json"
    path.write_text(json.dumps({"preset": preset, "cases": cases}, ensure_ascii=False, indent=1))
    return path
