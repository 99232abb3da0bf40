"""The manual pages and shell completion, generated from the parsers and the config
schema (tools/gen_docs.py), rendered by the real groff and man, and completion run by
the real bash."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qvld.config import DEPRECATED_KEYS, Config, iter_keys

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs")
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_docs.py"), str(out)],
                   check=True, capture_output=True, timeout=120,
                   env={**os.environ, "SOURCE_DATE_EPOCH": "1764633600"})
    return out


def rendered(page: Path) -> str:
    out = subprocess.run(["man", "-l", "-P", "cat", str(page)], capture_output=True,
                         text=True, timeout=60, check=True,
                         env={**os.environ, "MANWIDTH": "100", "LC_ALL": "C.UTF-8"})
    return out.stdout


@pytest.mark.parametrize("name", ["qvld.8", "qvlctl.1", "qvld.yaml.5"])
def test_each_page_is_clean_roff_and_renders(docs: Path, name: str) -> None:
    page = docs / "man" / name
    check = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(page)],
                           capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0 and check.stderr == "", check.stderr
    text = rendered(page)
    assert re.search(r"^NAME\n", text, re.M) and "2025-12-02" in text  # SOURCE_DATE_EPOCH


def test_the_name_lines_read_as_plain_text(docs: Path) -> None:
    """#46: qvld(8)'s NAME line showed 'Qwen3\\-VL' (escaped twice): what whatis and
    apropos print."""
    text = rendered(docs / "man" / "qvld.8")
    name = text.split("NAME\n", 1)[1].splitlines()[0].strip()
    assert name == "qvld - the Qwen3-VL vision-language daemon", name


def test_the_config_page_has_every_key_with_its_default(docs: Path) -> None:
    text = rendered(docs / "man" / "qvld.yaml.5")
    flat = re.sub(r"\s+", " ", text)
    for key in iter_keys():
        assert f"{key}:" in flat, key
    assert "engine.grammar_compile_timeout_s: float (default: 5.0)" in flat
    assert "(see etc/qvld/qvld.yaml)" not in flat  # every key has its text
    assert len(re.findall(r"\(default: ", flat)) == len(iter_keys()) == sum(
        len(type(getattr(Config(), s)).model_fields) for s in Config.model_fields
    ) - len(DEPRECATED_KEYS)
    # A deprecated key is listed apart, with what the operator should know of it.
    deprecated = flat.split("DEPRECATED KEYS", 1)[1]
    assert all(f"{key} no effect" in deprecated for key in DEPRECATED_KEYS)


def test_the_program_pages_follow_the_parsers(docs: Path) -> None:
    qvlctl = re.sub(r"\s+", " ", rendered(docs / "man" / "qvlctl.1"))
    for command in ("ask", "chat", "model", "preflight", "metrics", "sessions", "health",
                    "status", "config", "reload"):
        assert f"qvlctl {command}" in qvlctl, command
    for option in ("--json-schema", "--regex", "--grammar", "--version"):
        assert option in qvlctl, option
    assert "Exit codes: 0 ok" in qvlctl and "141 stdout closed" in qvlctl  # the epilog
    qvld = re.sub(r"\s+", " ", rendered(docs / "man" / "qvld.8"))
    assert "check-config" in qvld and "--set" in qvld and "78" in qvld


def complete(script: Path, words: list[str]) -> list[str]:
    """What bash offers for the last of ``words`` (shtab's function, as complete -F runs
    it)."""
    prog = words[0]
    words_text = " ".join(f"'{w}'" for w in words)
    code = (f"source '{script}'; COMP_WORDS=({words_text}); COMP_CWORD={len(words) - 1}; "
            f"_shtab_{prog} {prog} '{words[-1]}' '{words[-2]}'; "
            "printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=60,
                         check=True)
    return out.stdout.split()


def test_bash_completes_commands_and_options(docs: Path) -> None:
    qvlctl = docs / "completion" / "qvlctl"
    assert complete(qvlctl, ["qvlctl", "as"]) == ["ask"]
    assert "--json-schema" in complete(qvlctl, ["qvlctl", "ask", "--json-s"])
    assert "--messages" in complete(qvlctl, ["qvlctl", "ask", "--mess"])
    assert set(complete(docs / "completion" / "qvld", ["qvld", "check"])) == {"check-config"}
    for name in ("_qvlctl", "_qvld"):
        first = (docs / "completion" / name).read_text().splitlines()[0]
        assert first == f"#compdef {name[1:]}"


def test_every_option_says_what_it_does() -> None:
    """A page (and --help) lists no bare option: each has its help text."""
    from qvlctl.cli import build_parser as qvlctl_parser
    from qvld.cli import build_parser as qvld_parser

    def actions(parser: Any) -> list[Any]:
        found = list(parser._actions)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += actions(sub)
        return found

    bare = [a.option_strings or a.dest for p in (qvlctl_parser(), qvld_parser())
            for a in actions(p) if not a.help]
    assert bare == [], bare


def test_the_build_tools_are_pinned_alike_for_tests_and_packages() -> None:
    pinned = {line.strip() for line in (ROOT / "packaging" / "docs-requirements.txt")
              .read_text().splitlines() if line.strip() and not line.startswith("#")}
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert pinned and all(f'"{pin}"' in pyproject for pin in pinned), pinned


@pytest.mark.parametrize(("name", "section"), [("qvld.8", "8"), ("qvlctl.1", "1"),
                                               ("qvld.yaml.5", "5")])
def test_each_page_declares_its_own_section(docs: Path, name: str, section: str) -> None:
    first = (docs / "man" / name).read_text().splitlines()[0]
    assert re.match(rf'\.TH \S+ "?{section}"? ', first), first
