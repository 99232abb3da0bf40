"""One error tree for qvld.

Every error carries a stable ``code`` (the wire protocol's error codes) and whether a
retry may succeed, and round-trips through ``to_wire``/``from_wire`` so a client raises
the same class the daemon raised.
"""

from __future__ import annotations

from typing import Any, ClassVar


class QvlError(Exception):
    """Base of every error qvld reports; ``code`` is stable across versions."""

    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code)
        self.message = message or self.code

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "retryable": self.retryable}

    @staticmethod
    def from_wire(error: dict[str, Any]) -> QvlError:
        cls = ERRORS_BY_CODE.get(str(error.get("code")), InternalError)
        return cls(str(error.get("message", "")))


class BadRequest(QvlError):
    code = "bad_request"


class UnsupportedVersion(QvlError):
    code = "unsupported_version"


class FrameTooLarge(QvlError):
    code = "frame_too_large"


class ImageInvalid(QvlError):
    code = "image_invalid"


class ImageTooLarge(QvlError):
    code = "image_too_large"


class VideoInvalid(QvlError):
    """A video that cannot be used: not a readable clip, no frames, too long, too large."""

    code = "video_invalid"


class PromptTooLong(QvlError):
    code = "prompt_too_long"


class Busy(QvlError):
    code = "busy"
    retryable = True


class SessionLost(QvlError):
    """A request said how many turns its session holds (``session_turns``) and the daemon's
    session holds another count: it ended (restart, expiry, eviction, close) or moved on.
    Nothing ran; the client resends the history it holds."""

    code = "session_lost"


class Timeout(QvlError):
    code = "timeout"


class Forbidden(QvlError):
    code = "forbidden"


class Unavailable(QvlError):
    code = "unavailable"
    retryable = True


class InternalError(QvlError):
    code = "internal"


class ModelInvalid(QvlError):
    """The model directory is missing, incomplete or inconsistent (exit 78)."""

    code = "model_invalid"


ERRORS_BY_CODE: dict[str, type[QvlError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        UnsupportedVersion,
        FrameTooLarge,
        ImageInvalid,
        ImageTooLarge,
        VideoInvalid,
        PromptTooLong,
        Busy,
        SessionLost,
        Timeout,
        Forbidden,
        Unavailable,
        InternalError,
        ModelInvalid,
    )
}
