"""The journal's native protocol, read back from a real datagram socket the way journald
reads it (the systemd guest test checks the real journald: tests/test_systemd_guest.py)."""

from __future__ import annotations

import io
import logging
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from qvld.journal import JournalHandler, field_name, stderr_fallback
from qvld.logfields import log_request


def parse(datagram: bytes) -> dict[str, str]:
    """journald's reading of a native-protocol entry."""
    fields: dict[str, str] = {}
    rest = datagram
    while rest:
        line, sep, after = rest.partition(b"\n")
        assert sep, "an entry ends every field with a newline"
        if b"=" in line:
            name, _, value = line.partition(b"=")
            fields[name.decode()] = value.decode()
            rest = after
        else:  # NAME \n length (u64 LE) value \n
            (size,) = struct.unpack("<Q", after[:8])
            value, end = after[8:8 + size], after[8 + size:8 + size + 1]
            assert end == b"\n"
            fields[line.decode()] = value.decode()
            rest = after[9 + size:]
    return fields


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[socket.socket, logging.Logger, io.StringIO]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "journal.sock"
    sock.bind(str(path))
    sock.settimeout(5)
    stderr = io.StringIO()
    fallback = stderr_fallback(logging.Formatter("<%(levelno)s>%(message)s"))
    fallback.stream = stderr  # type: ignore[attr-defined]
    handler = JournalHandler(fallback, path=str(path))
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logger = logging.getLogger(f"qvld.test-journal.{id(sock)}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield sock, logger, stderr
    handler.close()
    sock.close()


def test_a_request_line_carries_its_fields_as_journal_fields(
        journal: tuple[socket.socket, logging.Logger, io.StringIO]) -> None:
    sock, logger, stderr = journal
    log_request("request %d/%s op=%s outcome=%s time=%.3fs", (3, 7, "generate", "ok", 0.5), {
        "api": "socket", "op": "generate", "outcome": "ok", "uid": 1000, "time_s": 0.5,
        "ttft_s": 0.125, "generated_tokens": 12, "user": None, "response_format": "regex"},
        logger=logger)
    entry = parse(sock.recv(65536))
    assert entry["MESSAGE"].endswith("request 3/7 op=generate outcome=ok time=0.500s "
                                      "ttft_s=0.125 generated_tokens=12 "
                                      "response_format=regex")
    assert entry["PRIORITY"] == "6" and entry["SYSLOG_IDENTIFIER"] == "qvld"
    assert entry["QVLD_OP"] == "generate" and entry["QVLD_OUTCOME"] == "ok"
    assert entry["QVLD_UID"] == "1000" and entry["QVLD_TTFT_S"] == "0.125"
    assert entry["QVLD_GENERATED_TOKENS"] == "12" and "QVLD_USER" not in entry
    assert stderr.getvalue() == ""


def test_a_refusal_is_a_warning_and_a_traceback_keeps_its_lines(
        journal: tuple[socket.socket, logging.Logger, io.StringIO]) -> None:
    sock, logger, _ = journal
    log_request("request %d op=%s outcome=%s", (1, "generate", "bad_request"),
                {"op": "generate", "outcome": "bad_request"}, logger=logger)
    assert parse(sock.recv(65536))["PRIORITY"] == "4"
    try:
        raise RuntimeError("line one\nline two")
    except RuntimeError:
        logger.exception("it failed")
    entry = parse(sock.recv(65536))
    assert entry["PRIORITY"] == "3"
    assert "line one\nline two" in entry["MESSAGE"] and "Traceback" in entry["MESSAGE"]


def test_without_journald_nothing_is_lost(tmp_path: Path) -> None:
    stderr = io.StringIO()
    fallback = stderr_fallback(logging.Formatter("<%(levelno)s>%(message)s"))
    fallback.stream = stderr  # type: ignore[attr-defined]
    handler = JournalHandler(fallback, path=str(tmp_path / "no-such-socket"))
    logger = logging.getLogger("qvld.test-journal.missing")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.warning("still said")
    handler.close()
    assert stderr.getvalue() == "<30>still said\n"


def test_field_names_are_what_journald_accepts() -> None:
    assert field_name("ttft_s") == "QVLD_TTFT_S"
    assert field_name("prompt-text.x") == "QVLD_PROMPT_TEXT_X"
