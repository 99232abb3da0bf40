"""Log records to journald over its native protocol: a request line's fields become
structured fields (``QVLD_OP=generate``, ``QVLD_TTFT_S=0.41``, ...), so that
``journalctl -u qvld QVLD_OUTCOME=internal`` or ``-o json`` finds them without parsing.

The protocol (systemd's "Native Journal Protocol"): one datagram per entry to
``/run/systemd/journal/socket``, each field ``NAME=value\\n``, or for a value holding a
newline ``NAME\\n`` + its length as 64-bit little-endian + the value + ``\\n``. An entry
that cannot be sent (no journald, a datagram too large) goes to stderr as before, with
its sd-daemon priority prefix, so nothing is lost. No library: python-systemd needs
libsystemd headers to build, and this is the whole of what qvld needs from it.
"""

from __future__ import annotations

import logging
import re
import socket
import struct
import sys
from typing import ClassVar

from qvld.logfields import FIELDS_ATTR

JOURNAL_SOCKET = "/run/systemd/journal/socket"
FIELD_NAME = re.compile(r"[^A-Z0-9_]")


def field(name: str, value: str) -> bytes:
    data = value.encode("utf-8", "replace")
    key = name.encode("ascii")
    if b"\n" in data:
        return key + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return key + b"=" + data + b"\n"


def field_name(key: str) -> str:
    """A request field's journal name: QVLD_ and upper case letters, digits and _."""
    return "QVLD_" + FIELD_NAME.sub("_", key.upper())


class JournalHandler(logging.Handler):
    PRIORITY: ClassVar[dict[int, int]] = {
        logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
        logging.CRITICAL: 2}

    def __init__(self, fallback: logging.Handler, path: str = JOURNAL_SOCKET,
                 identifier: str = "qvld") -> None:
        super().__init__()
        self.fallback = fallback
        self.path = path
        self.identifier = identifier
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def entry(self, record: logging.LogRecord) -> bytes:
        parts = [field("MESSAGE", self.format(record)),
                 field("PRIORITY", str(self.PRIORITY.get(record.levelno, 6))),
                 field("SYSLOG_IDENTIFIER", self.identifier),
                 field("QVLD_LOGGER", record.name)]
        for key, value in getattr(record, FIELDS_ATTR, {}).items():
            if value is not None:
                parts.append(field(field_name(key), str(value)))
        return b"".join(parts)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._socket.sendto(self.entry(record), self.path)
        except OSError:
            self.fallback.emit(record)

    def close(self) -> None:
        self._socket.close()
        super().close()


def stderr_fallback(formatter: logging.Formatter) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    return handler
