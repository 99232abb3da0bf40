"""What a route is, and what the routes of each dialect (``qvld.http.routes``) use of
the HTTP front: who is calling, bodies, the one generation path, image fetching.

A route names its op (what metrics and logs call it), its API (the metrics' ``api``
label) and the shape of its errors; the front's middleware reads all three, so a
handler only answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from qvld import protocol
from qvld.config import HttpConfig
from qvld.handlers import DaemonState
from qvld.http import openai
from qvld.http.body import BodyReader
from qvld.http.callers import Callers
from qvld.http.dialect import bad
from qvld.http.media import RemoteImage
from qvld.http.streaming import Generations
from qvld.metrics import Metrics

SESSION_HEADER = "X-Qvld-Session"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A dialect's error answer: (HTTP status, body) for a qvld error or an HTTP-level one.
ErrorShape = Callable[..., tuple[int, dict[str, Any]]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    op: str  # what metrics and logs call it ("generate", "models", ...)
    api: str = "http"  # the metrics' api label: "http" is OpenAI's API
    error_body: ErrorShape = openai.error_body


class Front(Protocol):
    """What a dialect's routes use of the HTTP front (``server.HttpFront``)."""

    state: DaemonState
    metrics: Metrics
    bodies: BodyReader
    callers: Callers
    generations: Generations

    @property
    def config(self) -> HttpConfig:
        """The http section, as the last reload left it."""

    async def fetch_images(self, remote: list[RemoteImage]) -> None:
        """Each remote image's bytes put in its part, or a 400 when fetching is off."""

    def model_name(self) -> str:
        """The served model's name ("qvld" while none is loaded)."""


def session_header(request: web.Request) -> str | None:
    """X-Qvld-Session (protocol v1's session), checked."""
    session = request.headers.get(SESSION_HEADER)
    if session is not None and not protocol.SESSION_ID.fullmatch(session):
        raise bad(SESSION_HEADER, f"{SESSION_HEADER} must be 1-128 characters of "
                         "[A-Za-z0-9._-]")
    return session


def error_response(status: int, body: dict[str, Any],
                   headers: Any = None) -> web.Response:
    """An error in a dialect's shape, with the headers its status calls for."""
    extra = dict(headers or {})
    if status in (429, 503):
        extra["Retry-After"] = "1"
    if status == 401:
        extra["WWW-Authenticate"] = 'Bearer realm="qvld"'
    return web.json_response(body, status=status, headers=extra)
