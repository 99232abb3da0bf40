"""The built-in web page (``/``): static files shipped in the package, served as they are.

The page (``web/index.html``, ``app.css``, ``app.js``, ``markdown.js``, ``store.js``:
plain HTML, CSS and JavaScript, no build step) talks to the public API only
(``/v1/chat/completions`` streamed, with a session header; ``/v1/models``;
``/health``), so whatever it does a script could do. It
needs no key to load: it holds nothing but itself, and asks for a key when the API
does. Every file is sent with a Content-Security-Policy that allows only this origin
(and ``blob:`` pictures and clips: those picked, and those kept in the browser),
nothing loaded from elsewhere, and an ETag: browsers keep it and revalidate (304) on
each load.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources

from aiohttp import web

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
       "media-src 'self' blob:; "
       "connect-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets() -> dict[str, Asset]:
    """URL path -> file, read once from the package (``/`` is index.html)."""
    folder = resources.files("qvld.http") / "web"
    assets: dict[str, Asset] = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if not entry.is_file() or suffix not in TYPES:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        path = "/" if entry.name == "index.html" else f"/ui/{entry.name}"
        assets[path] = Asset(body, TYPES[suffix], etag)
    # Browsers ask for /favicon.ico whatever the page links (bookmarks, tab restores):
    # the page's icon, not a 404 logged under no op.
    assets["/favicon.ico"] = assets["/ui/icon.svg"]
    return assets


def respond(asset: Asset, request: web.Request) -> web.Response:
    headers = {"ETag": asset.etag, "Cache-Control": "no-cache",
               "Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}
    wanted = request.headers.get("If-None-Match", "")
    if asset.etag in (tag.strip() for tag in wanted.split(",")):
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, headers={**headers,
                                                  "Content-Type": asset.content_type})
