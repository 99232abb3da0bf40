"""A question from the command line -> protocol v1 ``generate`` params: the pictures and
clips it names (told apart by their first bytes), or a messages file whose parts name
files beside it; the question (the words that name no file, or stdin); the sampling
and response-format flags."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from qvlctl.exits import UsageError


def read_image(name: str, base: Path | None = None) -> bytes:
    if name == "-":
        return sys.stdin.buffer.read()
    path = Path(name)
    if base is not None and not path.is_absolute():
        path = base / path
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read image {path}: {exc.strerror or exc}") from exc


def is_video(data: bytes) -> bool:
    """A clip by its first bytes: MP4/MOV (an ftyp box), WebM/Matroska (EBML), AVI."""
    pictures = (b"heic", b"heix", b"avif", b"mif1", b"msf1")  # ftyp boxes of still images
    return ((data[4:8] == b"ftyp" and data[8:12] not in pictures)
            or data[:4] == b"\x1a\x45\xdf\xa3"
            or (data[:4] == b"RIFF" and data[8:12] == b"AVI "))


def media_part(name: str, base: Path | None = None) -> dict[str, Any]:
    """An image or video part for a file, by what the file is."""
    data = read_image(name, base)
    return {"type": "video", "video": data} if is_video(data) else \
        {"type": "image", "image": data}


def messages_from_file(path: Path) -> list[dict[str, Any]]:
    """A JSON array of messages; image parts name files relative to the JSON file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read messages from {path}: {exc}") from exc
    if not isinstance(data, list):
        raise UsageError(f"{path}: expected a JSON array of messages")
    out = []
    for message in data:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            content = []
            for part in message["content"]:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image", "video"):
                    if not isinstance(part.get(kind), str):
                        raise UsageError(f"{path}: an {kind} part needs a file name")
                    part = {"type": kind, kind: read_image(part[kind], path.parent)}
                content.append(part)
            message = {**message, "content": content}
        out.append(message)
    return out


def ask_params(args: argparse.Namespace) -> dict[str, Any]:
    if args.messages is not None:
        if args.args:
            raise UsageError("--messages takes no IMAGE or QUESTION arguments")
        messages = messages_from_file(args.messages)
    else:
        images, question = split_ask_args(args.args, sys.stdin)
        content: list[dict[str, Any]] = [media_part(i) for i in images]
        content.append({"type": "text", "text": question})
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": content})
    params: dict[str, Any] = {"messages": messages, **sampling_params(args)}
    if args.session is not None:
        params["session"] = args.session
    response_format = response_format_param(args)
    if response_format is not None:
        params["response_format"] = response_format
    return params


# What names a picture or a clip when no such file exists: a typo, not a question.
MEDIA_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".mp4",
                            ".webm", ".mkv", ".avi", ".mov", ".m4v"})


def split_ask_args(words: list[str], stdin: Any) -> tuple[list[str], str]:
    """``ask``'s arguments -> (picture and clip files, the question), as ``ollama run``
    finds them: an argument naming a file (or ``-``, stdin) is one; one that looks like a
    picture's or clip's name but names no file is refused; the rest, joined, is the
    question, read from stdin when none is given and stdin is not a terminal."""
    media: list[str] = []
    text: list[str] = []
    for word in words:
        if word == "-" or Path(word).is_file():
            media.append(word)
        elif Path(word).suffix.lower() in MEDIA_SUFFIXES and " " not in word:
            raise UsageError(f"cannot read image {word}: no such file")
        else:
            text.append(word)
    question = " ".join(text)
    if not question and "-" not in media and not stdin.isatty():
        question = stdin.read().strip()
    if not question:
        raise UsageError("ask needs a QUESTION (beside any IMAGE files, or on stdin) or "
                         "--messages FILE")
    return media, question


def read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {what} {path}: {exc}") from None


def response_format_param(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--json-schema FILE`` / ``--json-object`` / ``--regex`` / ``--grammar FILE``: what
    the answer must match (the daemon checks the content)."""
    if args.json_schema is not None:
        text = read_text(args.json_schema, "the JSON Schema")
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise UsageError(f"{args.json_schema} is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise UsageError(f"{args.json_schema} must hold a JSON Schema object")
        # As JSON text: a schema may nest deeper than a protocol frame's maps may.
        return {"type": "json_schema", "schema": text}
    if args.json_object:
        return {"type": "json_object"}
    if args.regex is not None:
        return {"type": "regex", "pattern": args.regex}
    if args.grammar is not None:
        return {"type": "grammar", "grammar": read_text(args.grammar, "the grammar")}
    return None


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for key in ("max_tokens", "temperature", "top_p", "top_k", "seed", "max_image_tokens",
                "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value
    if getattr(args, "stop", None):
        params["stop"] = args.stop
    return params
