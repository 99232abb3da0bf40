"""qvlctl's exit codes, shared by the one-shot commands (cli.py) and `chat`.

Scripts branch on these, so a meaning never changes once published (cli.py's
docstring lists them for people).
"""

from __future__ import annotations

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_NO_DAEMON = 0, 1, 2, 3
EXIT_REFUSED, EXIT_RETRY, EXIT_TIMEOUT, EXIT_FORBIDDEN = 4, 5, 6, 7
EXIT_INTERRUPTED = 130  # the shell's convention for a process ended by Ctrl-C (128 + SIGINT)
EXIT_STDOUT_CLOSED = 141  # as a writer killed by SIGPIPE (128 + 13): `qvlctl ... | head`

EXIT_BY_CODE = {
    "bad_request": EXIT_REFUSED, "image_invalid": EXIT_REFUSED,
    "image_too_large": EXIT_REFUSED, "video_invalid": EXIT_REFUSED,
    "prompt_too_long": EXIT_REFUSED, "session_lost": EXIT_REFUSED,
    "frame_too_large": EXIT_REFUSED, "unsupported_version": EXIT_REFUSED,
    "busy": EXIT_RETRY, "unavailable": EXIT_RETRY, "timeout": EXIT_TIMEOUT,
    "forbidden": EXIT_FORBIDDEN,
}


def for_error_code(code: str) -> int:
    """The exit code for a daemon error code; unknown codes are internal errors."""
    return EXIT_BY_CODE.get(code, EXIT_INTERNAL)


class UsageError(Exception):
    """What the command line asked for cannot be done as written (exit 2)."""
