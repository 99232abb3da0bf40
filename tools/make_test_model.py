"""Build random-weight Qwen3-VL models and their transformers reference outputs.

    python tools/make_test_model.py tiny OUT_DIR [--reference]
    python tools/make_test_model.py qwen3-vl-2b OUT_DIR --weight-format int8
    python tools/make_test_model.py qwen3-vl-2b HF_DIR --hf-only

Each preset is a real ``transformers.Qwen3VLConfig``; the model is initialised from a
fixed seed, saved in the Hugging Face layout under ``OUT_DIR/hf`` and exported with the
real optimum-intel exporter (``optimum-cli export openvino``) to ``OUT_DIR``; with
``--onnx`` also as fp32 ONNX graphs (``qvlctl model export-onnx``'s exporter). With
``--reference`` the greedy token ids transformers (fp32) generates for the reference
cases are written to ``OUT_DIR/reference.json`` (and, for image cases, the processor's
``pixel_values`` and grids to ``OUT_DIR/reference_pixels.npz``). With ``--hf-only`` the
checkpoint alone is written to ``OUT_DIR`` (for ``qvlctl model convert`` and other
runtimes' converters).

Needs the ``convert`` extra (torch, transformers, optimum-intel); never imported by qvld.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# Qwen's added tokens in Qwen's order (ids follow the base vocabulary); the bool says
# whether the token is "special" (skipped when decoding with skip_special_tokens).
QWEN_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# Qwen3-VL-2B-Instruct's own chat template (tools, video placeholders, add_vision_id),
# as its model repository ships it.
CHAT_TEMPLATE = (Path(__file__).with_name("qwen3_vl_chat_template.jinja")
                 .read_text(encoding="utf-8"))

# Offline corpus for the byte-level BPE: English, code-ish text, and non-ASCII scripts,
# so that the merges cover what the reference prompts contain.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is in this picture? Describe the image.",
    "A receipt shows the total, the tax and the date. How many people are in the photo?",
    "You are a helpful assistant. Answer briefly and precisely. The user asks a question.",
    "Systems that run on small CPU servers must answer fast, stay up and be observable.",
    "The daemon listens on a Unix socket, reads msgpack frames and streams tokens back.",
    "Red, green, blue, yellow, black and white are colours; circles, squares and lines.",
    "Grüße aus München! Ça va très bien, merci. ¿Qué tal? Добрый день. Καλημέρα.",
    "你好，世界。这张图片里有什么？图像中有一只猫和一只狗。 こんにちは、元気ですか。",
    "def main(argv=None) -> int: return 0  # numbers 0123456789 and symbols !@#$%^&*()",
    "Emoji are bytes too: 🌍🙂🚀 — dashes, “quotes” and ellipses…",
]

# The fixed image limits of each preset's preprocessor_config.json (in pixels).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "seed": 1234,
        "bpe_vocab": 1000,
        "vocab_multiple": 64,
        "text": {
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [6, 5, 5],
                "mrope_interleaved": True,
            },
            "max_position_embeddings": 4096,
        },
        "vision": {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [0, 1],
        },
        "min_pixels": 4 * 32 * 32,
        "max_pixels": 256 * 32 * 32,
        "repetition_penalty": 1.0,
        "init_std": 0.15,
    },
    "tiny-alt": {
        "seed": 4322,
        "bpe_vocab": 700,
        "vocab_multiple": 1,
        "text": {
            "hidden_size": 160,
            "intermediate_size": 320,
            "num_hidden_layers": 4,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "head_dim": 24,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [4, 4, 4],
                "mrope_interleaved": True,
            },
            "max_position_embeddings": 2048,
        },
        "vision": {
            "depth": 3,
            "hidden_size": 48,
            "intermediate_size": 96,
            "num_heads": 3,
            "patch_size": 8,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "num_position_embeddings": 144,
            "deepstack_visual_indexes": [1],
        },
        "min_pixels": 8 * 16 * 16,
        "max_pixels": 128 * 16 * 16,
        # Its own video settings (video_preprocessor_config.json), far from transformers'
        # class defaults (131 072-786 432 pixels at 2 fps): a model served without them
        # samples and sizes clips differently (#48).
        "video": {"size": {"shortest_edge": 8 * 16 * 16, "longest_edge": 96 * 16 * 16},
                  "fps": 1.0, "min_frames": 2, "max_frames": 16},
        "repetition_penalty": 1.1,
        "init_std": 0.15,
    },
    "qwen3-vl-2b": {
        "seed": 2025,
        "bpe_vocab": 4000,
        "pad_vocab_to": 151643,  # Qwen's real special-token ids start here
        "vocab_size": 151936,
        "text": {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
            "max_position_embeddings": 262144,
        },
        "vision": {
            "depth": 24,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_heads": 16,
            "patch_size": 16,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [5, 11, 17],
        },
        "min_pixels": 65536,
        "max_pixels": 16777216,
        "repetition_penalty": 1.0,
        "init_std": 0.02,
        "dtype": "bfloat16",
    },
}


def build_tokenizer(preset: dict[str, Any]) -> Any:
    """Train a byte-level BPE offline and wrap it as Qwen2Tokenizer with Qwen's tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=preset["bpe_vocab"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 4, trainer=trainer)
    state = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(state["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    # Filler entries keep Qwen's real special-token ids for the full-size preset; they are
    # plain ASCII so that they decode to text if a random model emits them.
    pad_to = preset.get("pad_vocab_to", 0)
    for i in range(len(vocab), pad_to):
        vocab[f"fill{i}"] = i
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)  # adds <|endoftext|> first
    for text, special in QWEN_ADDED_TOKENS:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = preset["text"]["max_position_embeddings"]
    return tok


def build_model(preset: dict[str, Any], tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t, _ in QWEN_ADDED_TOKENS}
    n = len(tokenizer)
    multiple = preset.get("vocab_multiple", 1)
    vocab_size = preset.get("vocab_size", -(-n // multiple) * multiple)
    std = preset["init_std"]
    text = dict(preset["text"], vocab_size=vocab_size, initializer_range=std,
                rms_norm_eps=1e-6, hidden_act="silu", pad_token_id=ids["<|endoftext|>"])
    vision = dict(preset["vision"], out_hidden_size=preset["text"]["hidden_size"],
                  initializer_range=std, hidden_act="gelu_pytorch_tanh", in_channels=3)
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(preset["seed"])
    dtype = getattr(torch, preset.get("dtype", "float32"))
    model = Qwen3VLForConditionalGeneration(config).to(dtype).eval()
    return model


def save_hf(preset_name: str, hf_dir: Path) -> None:
    from transformers import GenerationConfig, Qwen2VLImageProcessor

    preset = PRESETS[preset_name]
    tok = build_tokenizer(preset)
    model = build_model(preset, tok)
    hf_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    (hf_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    vis = preset["vision"]
    Qwen2VLImageProcessor(
        patch_size=vis["patch_size"],
        temporal_patch_size=vis["temporal_patch_size"],
        merge_size=vis["spatial_merge_size"],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": preset["min_pixels"], "longest_edge": preset["max_pixels"]},
    ).save_pretrained(hf_dir)
    if "video" in preset:
        (hf_dir / "video_preprocessor_config.json").write_text(json.dumps({
            "video_processor_type": "Qwen3VLVideoProcessor",
            "patch_size": vis["patch_size"], "temporal_patch_size": vis["temporal_patch_size"],
            "merge_size": vis["spatial_merge_size"], "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], **preset["video"]}, indent=2) + "\n")
    ids = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    GenerationConfig(
        bos_token_id=ids[1],
        pad_token_id=ids[1],
        eos_token_id=ids,
        do_sample=True,
        temperature=0.7,
        top_k=20,
        top_p=0.8,
        repetition_penalty=preset["repetition_penalty"],
    ).save_pretrained(hf_dir)


def export_openvino(hf_dir: Path, out_dir: Path, weight_format: str) -> None:
    """Run the real optimum-intel exporter, as a user would from the shell."""
    cli = Path(sys.executable).with_name("optimum-cli")
    cmd = [str(cli), "export", "openvino", "--model", str(hf_dir),
           "--task", "image-text-to-text", "--weight-format", weight_format,
           "--disable-convert-tokenizer", str(out_dir)]
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    subprocess.run(cmd, check=True, env=env)
    # The exporter copies tokenizer and processor files; keep the template beside them,
    # and every processor file the engine reads (as `qvlctl model convert` does).
    shutil.copy(hf_dir / "chat_template.jinja", out_dir / "chat_template.jinja")
    from qvld.modeltools.convert import copy_side_files

    copy_side_files(hf_dir, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path)
    parser.add_argument("--weight-format", default="fp32",
                        help="fp32, fp16, int8 or int4 (optimum-cli --weight-format)")
    parser.add_argument("--reference", action="store_true",
                        help="also write reference.json from transformers fp32")
    parser.add_argument("--onnx", action="store_true",
                        help="also export the fp32 ONNX graphs (model.backend: onnxruntime)")
    parser.add_argument("--keep-hf", action="store_true", help="keep OUT/hf after export")
    parser.add_argument("--hf-only", action="store_true",
                        help="write the transformers checkpoint to OUT and stop")
    args = parser.parse_args(argv)

    out: Path = args.out
    if args.hf_only:
        save_hf(args.preset, out)
        return 0
    hf_dir = out / "hf"
    save_hf(args.preset, hf_dir)
    export_openvino(hf_dir, out, args.weight_format)
    if args.onnx:
        from qvld.modeltools.onnx_export import export_fp32

        export_fp32(hf_dir, out)
    if args.reference:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from reference_cases import write_reference

        write_reference(hf_dir, out, args.preset)
    if not args.keep_hf:
        shutil.rmtree(hf_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
