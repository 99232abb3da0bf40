"""Manual pages and shell completion, generated from what they describe (build time).

    python tools/gen_docs.py OUT_DIR

writes ``OUT_DIR/man/{qvld.8, qvlctl.1, qvld.yaml.5}`` and
``OUT_DIR/completion/{qvld, qvlctl}`` (bash) and ``{_qvld, _qvlctl}`` (zsh).

- qvld(8) and qvlctl(1) come from the argparse parsers (argparse-manpage), so an option
  added to a parser is in its page without anyone editing one;
- qvld.yaml(5) comes from the configuration schema (every key, its type and default, in
  declaration order) with each key's text taken from the comments of the shipped
  ``etc/qvld/qvld.yaml`` (the one place the keys are explained);
- completion comes from the same parsers (shtab).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402

from qvld import __version__  # noqa: E402
from qvld.config import DEPRECATED_KEYS, Config  # noqa: E402

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[a-z_]+):(?P<value>[^#]*)(#\s?(?P<text>.*))?$")
COMMENT_LINE = re.compile(r"^ {20,}#\s?(?P<text>.*)$")


def build_date() -> str:
    """The date of the build: SOURCE_DATE_EPOCH where set (reproducible builds)."""
    import os

    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    moment = (datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc) if epoch
              else datetime.datetime.now(datetime.timezone.utc))
    return moment.strftime("%Y-%m-%d")


def roff(text: str) -> str:
    """Plain text safe in a roff paragraph."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return re.sub(r"^([.'])", r"\\&\1", text, flags=re.M)


def key_texts(yaml_path: Path) -> dict[str, str]:
    """section.key -> the comment text beside it (and the comment lines under it)."""
    texts: dict[str, list[str]] = {}
    section = ""
    current: str | None = None
    for line in yaml_path.read_text(encoding="utf-8").splitlines():
        match = KEY_LINE.match(line)
        if match and not match["indent"]:
            section, current = match["key"], None
            continue
        if match and len(match["indent"]) == 2 and section:
            current = f"{section}.{match['key']}"
            texts[current] = [match["text"]] if match["text"] else []
            continue
        comment = COMMENT_LINE.match(line)
        if comment and current is not None:
            texts[current].append(comment["text"])
        elif not line.strip():
            current = None
    return {key: " ".join(lines) for key, lines in texts.items()}


def type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(annotation))
    if origin is Literal:
        return " | ".join(str(a) for a in get_args(annotation))
    if origin is list:
        return f"list of {type_name(get_args(annotation)[0])}"
    if origin is not None and get_args(annotation):  # Annotated[int, Field(...)]
        return type_name(get_args(annotation)[0])
    if annotation is type(None):
        return "none (~)"
    return getattr(annotation, "__name__", str(annotation))


def default_text(value: Any) -> str:
    if value is None:
        return "~ (none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]" if value else "[]"
    if value == "":
        return '"" (empty)'
    return str(value)


def config_page(yaml_path: Path) -> str:
    texts = key_texts(yaml_path)
    out = [f'.TH QVLD.YAML 5 "{build_date()}" "qvld {__version__}" "File Formats"',
           ".SH NAME", "qvld.yaml \\- configuration of the qvld vision\\-language daemon",
           ".SH SYNOPSIS", "/etc/qvld/qvld.yaml",
           ".SH DESCRIPTION",
           roff("qvld reads this YAML file at start and on reload (SIGHUP, qvlctl reload). "
                "Every key has a default, so the file holds only what differs; "
                "qvld --set section.key=value overrides a key on the command line. "
                "qvld check-config validates a file and reports every error at once "
                "(exit 78), unknown keys with a did-you-mean. The keys, section by "
                "section, with their types and defaults:")]
    for section, info in Config.model_fields.items():
        model = info.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        out.append(f".SH {section.upper()}")
        for name, field in model.model_fields.items():
            key = f"{section}.{name}"
            if key in DEPRECATED_KEYS:
                continue
            out += [".TP", f"\\fB{section}.{roff(name)}\\fR: {roff(type_name(field.annotation))}"
                    f" (default: {roff(default_text(field.default))})",
                    roff(texts.get(key, "").strip() or "(see etc/qvld/qvld.yaml)")]
    out.append(".SH DEPRECATED KEYS")
    out.append(roff("Still accepted, with a warning in the log and from check-config:"))
    for key, why in DEPRECATED_KEYS.items():
        out += [".TP", f"\\fB{roff(key)}\\fR", roff(f"no effect: {why}.")]
    out += [".SH FILES", ".TP", "/etc/qvld/qvld.yaml", "the configuration",
            ".SH SEE ALSO", "\\fBqvld\\fR(8), \\fBqvlctl\\fR(1)", ""]
    return "\n".join(out)


def program_page(parser: argparse.ArgumentParser, section: int, description: str,
                 see_also: str) -> str:
    from argparse_manpage.manpage import Manpage

    page = str(Manpage(parser, _data={
        "prog": parser.prog, "manual_section": section, "description": description,
        "project_name": "qvld", "version": __version__, "date": build_date(),
        "manual_title": "qvld manual"}))
    if parser.epilog:  # exit codes and the like, as the parser's --help ends
        page += "\n.SH NOTES\n" + roff(parser.epilog.strip()) + "\n"
    return page + f".SH SEE ALSO\n{see_also}\n"


def generate(out: Path) -> list[Path]:
    import shtab

    from qvlctl.cli import build_parser as qvlctl_parser
    from qvld.cli import build_parser as qvld_parser

    man, completion = out / "man", out / "completion"
    man.mkdir(parents=True, exist_ok=True)
    completion.mkdir(parents=True, exist_ok=True)
    files = {
        # argparse-manpage escapes the description's hyphens itself: plain text here.
        man / "qvld.8": program_page(qvld_parser(), 8, "the Qwen3-VL vision-language daemon",
                                     "\\fBqvlctl\\fR(1), \\fBqvld.yaml\\fR(5)"),
        man / "qvlctl.1": program_page(qvlctl_parser(), 1, "ask qvld questions about "
                                       "images, and look at the daemon",
                                       "\\fBqvld\\fR(8), \\fBqvld.yaml\\fR(5)"),
        man / "qvld.yaml.5": config_page(ROOT / "etc" / "qvld" / "qvld.yaml"),
    }
    for name, parser in (("qvld", qvld_parser()), ("qvlctl", qvlctl_parser())):
        files[completion / name] = shtab.complete(parser, shell="bash")
        files[completion / f"_{name}"] = shtab.complete(parser, shell="zsh")
    for path, text in files.items():
        path.write_text(text, encoding="utf-8")
    return list(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
