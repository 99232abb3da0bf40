"""The full-size test checkpoint -> GGUF for llama.cpp (Q8_0, Q4_K_M and the mmproj).

    python bench/convert_gguf.py HF_DIR OUT_DIR [--llamacpp DIR]

Runs llama.cpp's own convert_hf_to_gguf.py (text model at bf16, vision projector at
f16) and llama-quantize. The test checkpoint's tokenizer is a byte-level BPE with
Qwen2's pre-tokenizer but a vocabulary of its own, so the converter cannot recognise it
by the hash of its token ids; it is declared "qwen2", which is what it is.
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
from pathlib import Path


def run_converter(llamacpp: Path, args: list[str]) -> None:
    """convert_hf_to_gguf.py in this process, with the pre-tokenizer declared."""
    sys.path[:0] = [str(llamacpp), str(llamacpp / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's converter package

    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # type: ignore[method-assign]
    sys.argv = ["convert_hf_to_gguf.py", *args]
    runpy.run_path(str(llamacpp / "convert_hf_to_gguf.py"), run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--llamacpp", type=Path, default=Path(os.environ.get(
        "QVLD_BENCH_CACHE", Path.home() / ".cache/qvld-bench")) / "llama.cpp")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        run_converter(args.llamacpp, args.child)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    full = args.out / "model-bf16.gguf"
    me = [sys.executable, __file__, str(args.hf), str(args.out), "--llamacpp",
          str(args.llamacpp), "--child"]
    if not full.exists():
        subprocess.run([*me, str(args.hf), "--outtype", "bf16", "--outfile", str(full)],
                       check=True)
    mmproj = args.out / "mmproj-f16.gguf"
    if not mmproj.exists():
        subprocess.run([*me, str(args.hf), "--mmproj", "--outtype", "f16", "--outfile",
                        str(mmproj)], check=True)
    quantize = args.llamacpp / "build/bin/llama-quantize"
    for kind in ("Q8_0", "Q4_K_M"):
        target = args.out / f"model-{kind}.gguf"
        if not target.exists():
            subprocess.run([str(quantize), str(full), str(target), kind], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
