"""One log line per request, with its fields as data.

The text formats render the fields as ``key=value`` after the message; ``logging.format:
json`` writes each as its own key (``LogRecord.qvld_fields``), beside an RFC 3339
timestamp, so that a log shipper filters on ``op`` or ``ttft_s`` without parsing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("qvld.server")
FIELDS_ATTR = "qvld_fields"
# Already in the message itself: not repeated after it in the text formats.
IN_MESSAGE = frozenset({"api", "connection", "request", "uid", "user", "op", "outcome",
                        "time_s", "method", "path"})


def render(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def log_request(message: str, args: tuple[Any, ...], fields: Mapping[str, Any],
                logger: logging.Logger = log) -> None:
    """``message % args`` with the request's other fields after it; INFO when it was
    served (or cancelled by its client), WARNING when refused or failed."""
    outcome = fields.get("outcome")
    extra = "".join(f" {key}={render(value)}" for key, value in fields.items()
                    if key not in IN_MESSAGE)
    logger.log(logging.INFO if outcome in ("ok", "cancelled") else logging.WARNING,
               message + "%s", *args, extra, extra={FIELDS_ATTR: dict(fields)})
